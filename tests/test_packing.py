"""Packed rows (several documents per row) on every layout, against the documents run one by one on one device:
loss, every gradient, the documents' logits and the loss after an AdamW step, for the three forms a batch marks its
documents with (restarting position_ids, cu_seq_lens, seq_idx), at tp (+sp), dp levels 0-3, ep (mixtral), pp (rows
and one padding-free row re-laid for the micro-batches), cp=2 and cp=4 (ring and all-to-all), cp=2 x tp=2 and
pp=2 x cp=2; documents of lengths 2 x cp does not divide, one longer than a chunk, padding at a row's end (gloo,
4 ranks). Then the cp layout's balance and block skipping on one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _checks import TOL
from _models import rel_err, tiny_config, whole_logits
from torch.distributed.tensor import DTensor

WORLD_SIZE = 4
ROWS = ((10, 17, 7), (21, 6, 4))  # two rows of 34 tokens; the second ends with 3 padding tokens
PAD = 3
MOE = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)


def documents(config, rows=ROWS, seed: int = 5) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per row, its documents as (input_ids, labels); a label in each document is ignored."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for lengths in rows:
        row = []
        for length in lengths:
            ids = torch.randint(1, config.vocab_size, (length,), generator=gen)
            labels = ids.clone()
            labels[length // 2] = -100
            row.append((ids, labels))
        out.append(row)
    return out


def packed_batch(docs, form: str = "position_ids", flat: bool = False) -> dict[str, torch.Tensor]:
    """The documents packed in rows (padded at the end to one length), marked as `form` says; `flat`: every
    document in one padding-free row (DataCollatorWithFlattening's layout)."""
    if flat:
        docs = [[doc for row in docs for doc in row]]
    length = max(sum(len(ids) for ids, _ in row) for row in docs) + (0 if flat else PAD)
    rows = len(docs)
    input_ids = torch.zeros(rows, length, dtype=torch.long)
    labels = torch.full((rows, length), -100, dtype=torch.long)
    positions = torch.zeros(rows, length, dtype=torch.long)
    seq_idx = torch.zeros(rows, length, dtype=torch.long)
    mask = torch.zeros(rows, length, dtype=torch.long)
    cu = [0]
    for r, row in enumerate(docs):
        start = 0
        for d, (ids, labs) in enumerate(row):
            end = start + len(ids)
            input_ids[r, start:end], labels[r, start:end] = ids, labs
            positions[r, start:end] = torch.arange(len(ids))
            seq_idx[r, start:end] = d
            mask[r, start:end] = 1
            cu.append(r * length + end)
            start = end
        seq_idx[r, start:] = len(row)
        if start < length:
            cu.append((r + 1) * length)
    batch = {"input_ids": input_ids, "labels": labels}
    if not bool(mask.all()):
        batch["attention_mask"] = mask
    if form == "position_ids":
        batch["position_ids"] = positions
    elif form == "cu_seq_lens":
        batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor(cu, dtype=torch.int32)
    else:
        batch["seq_idx"] = seq_idx
    return batch


def alone(model, docs) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """The documents run one by one: the token mean of their losses (with gradients) and each one's logits."""
    total, count, logits = 0.0, 0, []
    for row in docs:
        row_logits = []
        for ids, labels in row:
            out = model(input_ids=ids[None]).logits[0]
            total = total + F.cross_entropy(out[:-1].float(), labels[1:], ignore_index=-100, reduction="sum")
            count += int((labels[1:] != -100).sum())
            row_logits.append(out.detach())
        logits.append(row_logits)
    return total / count, logits


def _spans(docs, flat: bool):
    """(row, start, end) of every document in the packed batch, in the order `alone` lists them."""
    spans, row, start = [], 0, 0
    for r, row_docs in enumerate(docs):
        if not flat:
            row, start = r, 0
        for ids, _ in row_docs:
            spans.append((row, start, start + len(ids)))
            start += len(ids)
    return spans


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _expected(param, full: torch.Tensor) -> torch.Tensor:
    from optimum_parallel.expert_parallel import expert_layout

    for layout in (expert_layout(param), getattr(param, "shard_layout", None)):
        if layout is not None:
            full = layout.slice(full)
    return full


def check_packed(
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    sequence_parallel: bool = False,
    level: int = 0,
    strategy: str = "ring",
    impl: str = "eager",
    form: str = "position_ids",
    flat: bool = False,
    model_type: str = "llama",
    compile: bool | str = False,
) -> dict:
    """The parallel model on the packed batch (every dp replica gets it, so averages are exact) against the
    documents run alone on one device (`compile`: its decoder blocks compiled with that backend)."""
    import optimum_parallel as op
    from optimum_parallel.engine.compose import compose_training

    dp = dist.get_world_size() // (tp * pp * cp)
    mesh = op.init_mesh(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
    overrides = {"num_hidden_layers": 4 if pp > 1 else 2, **(MOE if model_type == "mixtral" else {})}
    config = tiny_config(model_type, **overrides)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config, attn_implementation=impl).float().eval()
    model = copy.deepcopy(reference)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    if tp > 1 or pp > 1 or cp > 1:
        model = parallelizer.parallelize(
            model,
            sequence_parallel_enabled=sequence_parallel,
            context_parallel_strategy=strategy,
            pipeline_parallel_num_microbatches=2 if pp > 1 else 1,
            compile=compile,
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    if dp * cp > 1:
        if tp > 1 or pp > 1 or cp > 1:
            model, optimizer = compose_training(model, optimizer, mesh, {}, op.DataParallelConfig(level))
        else:
            model, optimizer = op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": level}})

    docs = documents(config)
    batch = packed_batch(docs, form, flat)
    ref_loss, ref_logits = alone(reference, docs)
    ref_loss.backward()
    if pp > 1:
        loss = model.run_train(**batch)
    else:
        loss = model(**batch).loss
        loss.backward()
    expected = dict(reference.named_parameters())
    grads = {name: rel_err(_whole(p.grad), _expected(p, expected[name].grad)) for name, p in model.named_parameters()}
    worst = max(grads, key=grads.get)
    out = {"loss": rel_err(loss, ref_loss), "grad": grads[worst], "worst": worst, "grads": len(grads)}

    with torch.no_grad():
        logits = model.run_eval(**batch).logits if pp > 1 else model(**batch).logits
    if logits is not None:
        logits = whole_logits(model, logits)  # a pipeline's last stage returns the vocab-parallel head's shard
        got = torch.cat([logits[r, s:e] for r, s, e in _spans(docs, flat)])
        out["logits"] = rel_err(got, torch.cat([x for row in ref_logits for x in row]))
    for opt in (optimizer, ref_optimizer):
        opt.step()
        opt.zero_grad()
    ref_loss = alone(reference, docs)[0]
    if pp > 1:
        loss = model.run_train(**batch)
    else:
        loss = model(**batch).loss
        loss.backward()
    out["step"] = rel_err(loss, ref_loss)
    return out


def _assert_exact(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        assert result["grads"] > 0, result
        worst = max(result["loss"], result["grad"], result.get("logits", 0.0), result["step"])
        assert worst <= TOL, f"rank {rank}: {result}"


# ------------------------------------------------------------------------------------------------ one device


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("form", ["position_ids", "cu_seq_lens", "seq_idx"])
def test_one_device_gives_every_document_its_own_answer(impl, form):
    """The engine's pre-hook on a plain model (what every layout without cp or pp runs): each document gets what it
    gets alone; transformers alone attends across documents (it builds no document mask with a cache in use)."""
    from transformers import AutoModelForCausalLM

    from optimum_parallel.packing import install_packing

    config = tiny_config("llama")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=impl).float().eval()
    docs = documents(config)
    batch = packed_batch(docs, form)
    ref_loss, ref_logits = alone(model, docs)
    plain = model(**batch).loss
    install_packing(model)
    out = model(**batch)
    got = torch.cat([out.logits[r, s:e] for r, s, e in _spans(docs, False)])
    assert rel_err(out.loss, ref_loss) <= TOL
    assert rel_err(got, torch.cat([x for row in ref_logits for x in row])) <= TOL
    assert rel_err(plain, ref_loss) > 1e-3  # without the hook: across documents (and their boundary targets)


def test_flex_attention_honours_the_documents():
    """flex attention (where torch compiles it on this device): transformers' BlockMask from the packed positions."""
    from transformers import AutoModelForCausalLM

    from optimum_parallel.packing import install_packing

    config = tiny_config("llama")
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="flex_attention").float().eval()
        docs = documents(config)
        with torch.no_grad():
            ref_loss, _ = alone(model, docs)
        install_packing(model)
        with torch.no_grad():  # torch has no flex backward on CPU
            loss = model(**packed_batch(docs)).loss
    except Exception as err:  # no compiler / no flex kernel for this device
        pytest.skip(f"flex attention does not run here: {type(err).__name__}: {str(err)[:200]}")
    assert rel_err(loss, ref_loss) <= 1e-4  # flex's own kernel: the noise of another summation order


def test_pack_refuses_positions_that_contradict_the_boundaries():
    from optimum_parallel.packing import pack

    ids = torch.zeros(1, 8, dtype=torch.long)
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="position_ids must start again at every document seq_idx marks"):
        pack({"input_ids": ids, "seq_idx": seq_idx, "position_ids": torch.arange(8)[None]})
    assert pack({"input_ids": ids, "position_ids": torch.arange(8)[None]}) is None  # one document: untouched
    generate_like = {"input_ids": ids, "attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])}
    generate_like["position_ids"] = torch.tensor([[1, 1, 0, 1, 2, 3, 4, 5]])  # left padding, cumsum positions
    assert pack(generate_like) is None


# ------------------------------------------------------------------------------------------------ every layout


@pytest.mark.parametrize("form", ["position_ids", "cu_seq_lens", "seq_idx"])
def test_tensor_parallel(pool, form):
    """dp=2 x tp=2, sdpa: the plan's layers see the document mask transformers builds from the packed form."""
    _assert_exact(pool.run(check_packed, tp=2, impl="sdpa", form=form))


def test_tensor_and_sequence_parallel(pool):
    _assert_exact(pool.run(check_packed, tp=2, sequence_parallel=True))


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_data_parallel(pool, level):
    _assert_exact(pool.run(check_packed, level=level))


def test_expert_parallel(pool):
    """mixtral, dp=4 x ep=2: the experts split, tokens dispatched; the documents still their own."""
    _assert_exact(pool.run(check_packed, ep=2, model_type="mixtral"))


@pytest.mark.parametrize("flat", [False, True])
def test_pipeline(pool, flat):
    """pp=2 x tp=2, two micro-batches: packed positions travel with the activations; one padding-free row is laid
    out in two rows for the micro-batches (and its logits put back in place)."""
    _assert_exact(pool.run(check_packed, pp=2, tp=2, flat=flat))


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel(pool, cp, flat):
    """Rows of 34 tokens (cp=4: padded to 36, chunks of 3 tokens, documents of 21 > a chunk) or one row of 65."""
    _assert_exact(pool.run(check_packed, cp=cp, flat=flat))


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_context_parallel_all_to_all(pool, impl):
    _assert_exact(pool.run(check_packed, cp=2, strategy="all_to_all", impl=impl, form="cu_seq_lens"))


def test_context_and_tensor_parallel(pool):
    _assert_exact(pool.run(check_packed, cp=2, tp=2, form="seq_idx"))


def test_pipeline_and_context_parallel(pool):
    _assert_exact(pool.run(check_packed, pp=2, cp=2, flat=True))


@pytest.mark.parametrize("layout", [dict(tp=2, impl="sdpa"), dict(cp=2)], ids=["tp2", "cp2"])
def test_compiled_blocks(pool, layout):
    """Decoder blocks compiled (aot_eager): under tp the document mask reaches the compiled blocks as a tensor; under
    cp a packed row's attention runs eagerly inside them (its document blocks are chosen in Python)."""
    _assert_exact(pool.run(check_packed, compile="aot_eager", **layout))


# ------------------------------------------------------------------------------------------------ the cp layout


def test_ranks_share_the_attention_work_not_the_tokens():
    """One long document among many short ones (16k tokens): the busiest rank's document-masked pairs are within
    10% of the mean at cp=2, 4 and 8, every rank holds the same number of tokens; the zigzag of whole-row chunks is
    far off."""
    from optimum_parallel.context_parallel.packed import chunk_count, chunk_work, deal
    from optimum_parallel.packing import segment_ids

    lengths = [9000] + [37, 120, 400, 55, 800, 230, 64] * 20
    positions = torch.cat([torch.arange(n) for n in lengths])[:16384][None]
    segments = segment_ids(positions)
    for cp in (2, 4, 8):
        chunks, padded = chunk_count(16384, cp)
        assert padded == 16384
        work = chunk_work(segments, chunks)
        owned = deal(work, cp)
        loads = [sum(work[j] for j in mine) for mine in owned]
        assert len({len(mine) for mine in owned}) == 1
        assert max(loads) <= 1.1 * sum(loads) / cp, (cp, loads)
        zigzag = chunk_work(segments, 2 * cp)
        zig_loads = [zigzag[r] + zigzag[2 * cp - 1 - r] for r in range(cp)]
        assert max(zig_loads) > 1.2 * sum(zig_loads) / cp


def test_chunk_pairs_of_other_documents_are_skipped_and_the_rest_exact():
    """One process holding every chunk (the all-to-all path): packed attention equals softmax attention under the
    document mask (fp64, GQA), and pairs of chunks that share no document are never computed."""
    from optimum_parallel.context_parallel import blocks
    from optimum_parallel.context_parallel.blocks import Attend
    from optimum_parallel.context_parallel.packed import documents_for
    from optimum_parallel.context_parallel.ring import ring_attention
    from optimum_parallel.packing import segment_ids

    torch.manual_seed(0)
    lengths = [5, 14, 3, 26, 7, 9]  # 64 tokens
    positions = torch.cat([torch.arange(n) for n in lengths])[None].expand(2, -1)
    segments = segment_ids(positions)
    docs = documents_for(segments, 2, 0)
    layout = docs.layout
    order = tuple(i for r in range(2) for i in layout.chunks_of(r))
    index = torch.cat([torch.arange(i * layout.chunk, (i + 1) * layout.chunk) for i in order])
    b, heads, kv_heads, d, length = 2, 4, 2, 8, 64
    q = torch.randn(b, heads, length, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, kv_heads, length, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, kv_heads, length, d, dtype=torch.float64, requires_grad=True)
    pos = torch.arange(length)
    visible = (pos[None, :] <= pos[:, None]) & (segments[0][:, None] == segments[0][None, :])
    scores = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * d**-0.5
    expected = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v.repeat_interleave(2, 1)
    computed = []
    original = blocks.pair_forward

    def counting(q_, k_, v_, kind, visible_, attend, use_fused):
        computed.append(kind)
        return original(q_, k_, v_, kind, visible_, attend, use_fused)

    blocks.pair_forward = counting
    try:
        attend = Attend(layout.chunk, d**-0.5, None, None, None, docs)
        local = [t.detach()[:, :, index].requires_grad_() for t in (q, k, v)]
        out = ring_attention(*local, attend, lambda _: order, None)
    finally:
        blocks.pair_forward = original
    assert torch.allclose(out, expected[:, :, index], atol=1e-12)
    chunks = len(order)
    assert len(computed) < chunks * (chunks + 1) // 2  # pairs sharing no document skipped
    assert "full" in computed and "causal" in computed  # inside one document: no mask built
    grad = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
    out.backward(grad[:, :, index])
    for mine, theirs in zip(local, expected_grads, strict=True):
        assert torch.allclose(mine.grad, theirs[:, :, index], atol=1e-10)
