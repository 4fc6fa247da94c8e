"""Context parallelism for the attention variants beyond causal / sliding-window / soft-capped attention, against the
single-device transformers model: attention sinks (gpt_oss), chunked attention (llama4_text's `attention_chunk_size`)
and Gemma 3's image tokens that attend both ways (`token_type_ids`); ring and all-to-all strategies, padding and -100
labels, attention chunks and image blocks that cross the cp chunks' boundaries."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _models import rel_err

TOL = 1e-5
SEQ = 38  # padded to 40 inside: cp=2 cuts it in chunks of 10, llama4's attention chunks are 8 tokens (from the first
# real token), so neither boundary falls on the other


def _softmax_attention(q, k, v, visible, scale, sinks):
    """Plain attention over the whole sequence, with a sink logit per head in each softmax's denominator."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks[None, :, None, None].expand(*scores.shape[:-1], 1)], dim=-1)
    probs = torch.softmax(scores, -1)
    return probs[..., : v.shape[2]] @ v


@pytest.mark.parametrize("rule", ["sinks", "spans", "blocks", "sinks+window"])
@pytest.mark.parametrize("padded", [False, True])
def test_chunk_pairs_match_softmax_attention(rule, padded):
    """One process holding all 8 chunks in the all-to-all order: output and gradients (q, k, v and the sinks) of the
    chunk-pair attention equal plain softmax attention over the whole sequence (fused path, GQA)."""
    from optimum_parallel.context_parallel.attention import span_ids
    from optimum_parallel.context_parallel.blocks import Attend, Blocks, Spans
    from optimum_parallel.context_parallel.model import image_blocks
    from optimum_parallel.context_parallel.ring import ring_attention

    torch.manual_seed(0)
    b, heads, kv_heads, chunk, d = 2, 4, 2, 6, 8
    length = 8 * chunk
    order = (0, 7, 1, 6, 2, 5, 3, 4)
    index = torch.cat([torch.arange(i * chunk, (i + 1) * chunk) for i in order])
    q = torch.randn(b, heads, length, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, kv_heads, length, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, kv_heads, length, d, dtype=torch.float64, requires_grad=True)
    keys = torch.ones(b, length, dtype=torch.bool)
    if padded:
        keys[0, :9] = False  # left padding across a chunk boundary
        keys[1, -7:] = False
    pos = torch.arange(length)
    visible = (pos[None, :] <= pos[:, None])[None, None].expand(b, 1, length, length)
    window, spans, blocks, sinks = None, None, None, None
    if "sinks" in rule:
        sinks = torch.randn(heads, dtype=torch.float64, requires_grad=True)
    if "window" in rule:
        window = 13
        visible = visible & (pos[:, None] - pos[None, :] < window)
    if rule == "spans":  # attention chunks of 8 tokens from each row's first real token
        ids = span_ids(8, keys if padded else None, None, length, "cpu")
        visible = visible & (ids[:, None, :, None] == ids[:, None, None, :])
        spans = Spans.of(ids, chunk)
    if rule == "blocks":  # two images: one across chunks 1-3, one inside chunk 5
        types = torch.zeros(b, length, dtype=torch.long)
        types[:, 10:21] = 1
        types[0, 31:34] = 1
        types[1, 23:26] = 1
        ids = image_blocks(types)
        visible = visible | ((ids[:, None, :, None] == ids[:, None, None, :]) & (ids >= 0)[:, None, :, None])
        blocks = Blocks.of(ids, chunk)
    visible = visible & keys[:, None, None, :]
    scale = d**-0.5
    sees = visible.any(-1, keepdim=True)
    expected = torch.where(sees, _softmax_attention(q, k, v, visible | ~sees, scale, sinks), 0.0)
    attend = Attend(chunk, scale, window, None, keys if padded else None, spans=spans, blocks=blocks)
    local = [t.detach()[:, :, index].requires_grad_() for t in (q, k, v)]
    local_sinks = None if sinks is None else sinks.detach().clone().requires_grad_()
    out = ring_attention(*local, attend, lambda _: order, None, local_sinks)
    assert torch.allclose(out, expected[:, :, index], atol=1e-12)
    grad = torch.randn_like(expected).masked_fill(~sees, 0.0)
    inputs = (q, k, v) if sinks is None else (q, k, v, sinks)
    expected_grads = torch.autograd.grad(expected, inputs, grad)
    out.backward(grad[:, :, index])
    for mine, theirs in zip(local, expected_grads, strict=False):
        assert torch.allclose(mine.grad, theirs[:, :, index], atol=1e-10)
    if sinks is not None:
        assert torch.allclose(local_sinks.grad, expected_grads[3], atol=1e-10)


def test_pairs_that_see_nothing_are_skipped():
    """Attention chunks of 8 over cp chunks of 4: a query chunk sees no key chunk of an earlier attention chunk;
    an image block across chunks 1-2 makes chunk 2 visible to chunk 1 (masked), and chunk 1's diagonal masked."""
    from optimum_parallel.context_parallel.attention import span_ids
    from optimum_parallel.context_parallel.blocks import Attend, Blocks, Spans
    from optimum_parallel.context_parallel.model import image_blocks

    spans = Spans.of(span_ids(8, None, None, 16, "cpu"), 4)
    attend = Attend(4, 1.0, None, None, None, spans=spans)
    assert [attend.visibility(3, j) for j in range(4)] == ["none", "none", "full", "causal"]
    assert [attend.visibility(1, j) for j in range(4)] == ["full", "causal", "none", "none"]
    types = torch.zeros(1, 16, dtype=torch.long)
    types[0, 6:10] = 1
    attend = Attend(4, 1.0, None, None, None, blocks=Blocks.of(image_blocks(types), 4))
    assert [attend.visibility(1, j) for j in range(4)] == ["full", "masked", "masked", "none"]
    assert [attend.visibility(2, j) for j in range(4)] == ["full", "full", "masked", "none"]
    assert [attend.visibility(0, j) for j in range(4)] == ["causal", "none", "none", "none"]


# ------------------------------------------------------------------------------------- whole models on 4 processes

TEXT = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
CONFIGS = {
    # layer 0 sliding (window 8), layer 1 full; one sink logit per head in both
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=8),
    # sinks in a family without a hand-written plan (its plan from transformers' base_model_tp_plan)
    "flint": dict(sliding_window=8),
    # layer 0 chunked (8 tokens, rotary), layer 1 full without rotary; the NoPE layer's query temperature grows past
    # floor_scale tokens, so it differs between a token's place on its rank and in the whole sequence
    "llama4_text": dict(
        num_local_experts=4,
        num_experts_per_tok=1,
        intermediate_size=64,
        intermediate_size_mlp=96,
        interleave_moe_layer_step=1,
        attention_chunk_size=8,
        no_rope_layers=[1, 0],
        floor_scale=16,
        attn_scale=0.5,
    ),
}


def _config(model_type: str, overrides: dict | None = None):
    if model_type == "gemma3":
        from _vlm import TINY_VLM_CONFIGS

        return TINY_VLM_CONFIGS["gemma3"]()
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**TEXT, **CONFIGS.get(model_type, {}), **(overrides or {})})


def _build(config):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(0)
    auto = AutoModelForImageTextToText if config.model_type == "gemma3" else AutoModelForCausalLM
    model = auto.from_config(config, attn_implementation="eager").float().eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # zero-initialised biases (and sinks) would check nothing on the first step
        for param in model.parameters():
            if not param.any():
                param.copy_(0.02 * torch.randn(param.shape, generator=gen))
        for name, param in model.named_parameters():
            if name.endswith("sinks"):  # sinks of the size of the scores, so they take a visible share
                param.copy_(torch.randn(param.shape, generator=gen))
    return model


def variant_batch(config) -> tuple[dict, torch.Tensor]:
    """SEQ tokens, row 0 left-padded by 3 (its first real token's label ignored: it is predicted from a padding
    position), row 1 right-padded by 4, an ignored label in the middle; for Gemma 3 one image per row (make_vlm_inputs:
    row 0's image tokens at 8-11, across the chunk boundary at 10 of cp=2 and of cp=4). Also the tokens whose logits
    both sides define (real ones after the first of row 0)."""
    if config.model_type == "gemma3":
        from _vlm import make_vlm_inputs

        batch = make_vlm_inputs(config, batch=2, seq=SEQ)
        batch["attention_mask"][1, -4:] = 0
        batch["labels"][1, -4:] = -100
    else:
        gen = torch.Generator().manual_seed(1)
        input_ids = torch.randint(3, config.vocab_size, (2, SEQ), generator=gen)
        mask = torch.ones(2, SEQ, dtype=torch.long)
        mask[0, :3] = 0
        mask[1, -4:] = 0
        input_ids[mask == 0] = config.pad_token_id
        labels = input_ids.masked_fill(mask == 0, -100)
        labels[0, 3] = -100
        labels[:, SEQ // 2] = -100
        batch = {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
    real = batch["attention_mask"].bool().clone()
    real[0, :4] = False
    return batch, real


def _module_scales(model) -> dict[str, float]:
    """The largest gradient of each module: a gradient's error is measured on its module's scale (an analytically
    zero gradient, a key bias's, is fp32 rounding noise)."""
    scales: dict[str, float] = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            owner = name.rpartition(".")[0]
            scales[owner] = max(scales.get(owner, 0.0), param.grad.abs().max().item())
    return scales


def _grad_errors(model, reference) -> dict[str, float]:
    from test_expert_parallel_layouts import reference_slice, whole

    scales, expected = _module_scales(reference), dict(reference.named_parameters())
    errors = {}
    for name, param in model.named_parameters():
        wanted = expected[name].grad
        if param.grad is None or wanted is None:
            assert param.grad is None and wanted is None, f"{name}: a gradient on one side only"
            continue
        difference = (whole(param.grad).double() - reference_slice(param, wanted).double()).abs().max().item()
        errors[name] = difference / max(scales[name.rpartition(".")[0]], 1e-30)
    return errors


def check_variant(
    model_type: str,
    cp: int = 2,
    tp: int = 1,
    strategy: str = "ring",
    steps: int = 2,
    overrides: dict | None = None,
    compile: str | None = None,
) -> dict:
    """The cp model and one device on the same batch (every dp replica gets it, so averages are exact): loss, every
    gradient (the sinks' included), the whole sequence's logits, the loss after AdamW steps; and the same errors of one
    device started from weights perturbed by relative 1e-7 (fp32's noise floor)."""
    import optimum_parallel as op
    from optimum_parallel.engine.compose import compose_training

    if compile is not None:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
    mesh = op.init_mesh(dp=dist.get_world_size() // (cp * tp), cp=cp, tp=tp, timeout=60)
    config = _config(model_type, overrides)
    reference = _build(config)
    model = copy.deepcopy(reference)
    floor_model = copy.deepcopy(reference)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in floor_model.parameters():
            param.mul_(1 + 1e-7 * torch.randn(param.shape, generator=gen))
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model, context_parallel_strategy=strategy, compile=compile)
    optimizer = parallelizer.optimizer_for_mp(
        torch.optim.AdamW(model.parameters(), lr=1e-3), model.orig_param_to_parallel_param
    )
    model, optimizer = compose_training(model, optimizer, mesh, {}, op.DataParallelConfig(0))
    ref_optimizer, floor_optimizer = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (reference, floor_model))

    batch, real = variant_batch(config)
    losses = {}
    for name, m in (("cp", model), ("ref", reference), ("floor", floor_model)):
        losses[name] = m(**batch).loss
        losses[name].backward()
    result = {
        "loss": rel_err(losses["cp"], losses["ref"]),
        "floor_loss": rel_err(losses["floor"], losses["ref"]),
        "sinks": sum(name.endswith("sinks") for name, _ in model.named_parameters()),
    }
    grads, floor_grads = _grad_errors(model, reference), _grad_errors(floor_model, reference)
    result.update(grad=max(grads.values()), worst=max(grads, key=grads.get), floor_grad=max(floor_grads.values()))
    result["sinks_grad"] = max((e for n, e in grads.items() if n.endswith("sinks")), default=0.0)
    with torch.no_grad():
        logits, ref_logits = model(**batch).logits, reference(**batch).logits
    result["logits_shape"] = tuple(logits.shape)
    result["logits"] = rel_err(logits[real], ref_logits[real])
    steps_err, floor_steps = [], []
    for _ in range(steps):
        for opt in (optimizer, ref_optimizer, floor_optimizer):
            opt.step()
            opt.zero_grad()
        for name, m in (("cp", model), ("ref", reference), ("floor", floor_model)):
            losses[name] = m(**batch).loss
            losses[name].backward()
        steps_err.append(rel_err(losses["cp"], losses["ref"]))
        floor_steps.append(rel_err(losses["floor"], losses["ref"]))
    result.update(steps=max(steps_err), floor_steps=max(floor_steps))
    if compile is not None:
        counters = torch._dynamo.utils.counters
        result.update(graphs=counters["stats"].get("unique_graphs", 0), breaks=sum(counters["graph_break"].values()))
    return result


def _assert_equal(results: list[dict], sinks: bool = False) -> None:
    for rank, result in enumerate(results):
        tolerance = max(TOL, 2 * max(result["floor_loss"], result["floor_grad"], result["floor_steps"]))
        assert result["logits_shape"][:2] == (2, SEQ), result
        worst = max(result["loss"], result["grad"], result["logits"], result["steps"])
        assert worst <= tolerance, f"rank {rank}: {worst:.1e} > {tolerance:.1e}: {result}"
        if sinks:
            assert result["sinks"] == 2, result


@pytest.mark.parametrize(
    "model_type,cp,tp,strategy",
    [
        ("gpt_oss", 2, 1, "ring"),
        ("gpt_oss", 2, 1, "all_to_all"),
        ("gpt_oss", 4, 1, "ring"),
        ("gpt_oss", 2, 2, "ring"),  # each tp rank's heads' sinks
        ("flint", 2, 1, "ring"),
        ("llama4_text", 2, 1, "ring"),
        ("llama4_text", 2, 1, "all_to_all"),
        ("llama4_text", 4, 1, "ring"),
        ("gemma3", 2, 1, "ring"),
        ("gemma3", 2, 1, "all_to_all"),
        ("gemma3", 4, 1, "ring"),
    ],
    ids=lambda value: str(value),
)
def test_matches_one_device(pool, model_type, cp, tp, strategy):
    sinks = model_type in ("gpt_oss", "flint")
    _assert_equal(pool.run(check_variant, model_type, cp=cp, tp=tp, strategy=strategy), sinks=sinks)


@pytest.mark.parametrize(
    "model_type,strategy", [("gpt_oss", "all_to_all"), ("llama4_text", "ring"), ("gemma3", "ring")], ids=str
)
def test_compiled_blocks_match_one_device(pool, model_type, strategy):
    """Each decoder block compiled ("aot_eager"): the sinks, attention-chunk spans and image blocks reach the
    ring-attention custom op (compiled.py) as its inputs; no graph break."""
    results = pool.run(check_variant, model_type, strategy=strategy, compile="aot_eager")
    _assert_equal(results, sinks=model_type == "gpt_oss")
    for rank, result in enumerate(results):
        assert result["graphs"] > 0 and result["breaks"] == 0, f"rank {rank}: {result}"


def check_packed_variant(model_type: str, cp: int = 2, strategy: str = "ring") -> dict:
    """Packed rows (test_packing's documents: 17 and 21 tokens, longer than llama4's attention chunks of 8, which
    restart with each document's positions) under cp against the documents run alone on one device."""
    from test_packing import _spans, alone, documents, packed_batch

    import optimum_parallel as op
    from optimum_parallel.engine.compose import compose_training

    mesh = op.init_mesh(dp=dist.get_world_size() // cp, cp=cp, timeout=60)
    config = _config(model_type, {"floor_scale": 8192} if model_type == "llama4_text" else None)
    reference = _build(config)
    model = copy.deepcopy(reference)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model, context_parallel_strategy=strategy)
    optimizer = parallelizer.optimizer_for_mp(
        torch.optim.AdamW(model.parameters(), lr=1e-3), model.orig_param_to_parallel_param
    )
    model, optimizer = compose_training(model, optimizer, mesh, {}, op.DataParallelConfig(0))
    docs = documents(config)
    batch = packed_batch(docs)
    ref_loss, ref_logits = alone(reference, docs)
    ref_loss.backward()
    loss = model(**batch).loss
    loss.backward()
    grads = _grad_errors(model, reference)
    with torch.no_grad():
        logits = model(**batch).logits
    got = torch.cat([logits[r, s:e] for r, s, e in _spans(docs, False)])
    return {
        "loss": rel_err(loss, ref_loss),
        "grad": max(grads.values()),
        "worst": max(grads, key=grads.get),
        "logits": rel_err(got, torch.cat([x for row in ref_logits for x in row])),
    }


@pytest.mark.parametrize(
    "model_type,strategy", [("llama4_text", "ring"), ("llama4_text", "all_to_all"), ("gpt_oss", "ring")], ids=str
)
def test_packed_rows_match_documents_alone(pool, model_type, strategy):
    for rank, result in enumerate(pool.run(check_packed_variant, model_type, strategy=strategy)):
        assert max(result["loss"], result["grad"], result["logits"]) <= TOL, f"rank {rank}: {result}"
