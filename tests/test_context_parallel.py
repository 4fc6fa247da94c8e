"""Context parallelism (ring and all-to-all attention) against the single-device transformers model: loss, every
gradient, whole-sequence logits and the loss after AdamW steps, alone and composed with tp (+sp), dp at sharding
levels 0-3, pp and activation checkpointing; padding, ignored labels and lengths cp does not divide."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _checks import TOL
from _models import build_model, make_batch, rel_err, tiny_config
from torch.distributed.tensor import DTensor

WINDOW = 8  # sliding-window families: shorter than the test sequences, so whole chunk pairs drop out


def cp_config(model_type: str, **overrides):
    extra = {"num_hidden_layers": 2}
    if model_type in ("mistral", "gemma2", "qwen3"):
        extra["sliding_window"] = WINDOW
    if model_type == "qwen3":  # layer 0 sliding, layer 1 full
        extra.update(use_sliding_window=True, max_window_layers=1)
    return tiny_config(model_type, **{**extra, **overrides})


def cp_batch(config, length: int = 30, rows: int = 2) -> dict[str, torch.Tensor]:
    """Left padding (row 0), right padding (row 1), an ignored label in the middle. The first real token after
    left padding has no real context (transformers attends it to masked keys, ring attention to none), so its
    label is ignored, as it carries no information either way."""
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, config.vocab_size, (rows, length), generator=gen)
    mask = torch.ones(rows, length, dtype=torch.long)
    labels = input_ids.clone()
    mask[0, :3] = 0
    labels[0, :4] = -100
    mask[1, -4:] = 0
    labels[1, -4:] = -100
    labels[:, length // 2] = -100
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _reference(config, impl: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=impl).float()


def check_context(
    model_type: str = "llama",
    *,
    cp: int = 2,
    tp: int = 1,
    strategy: str = "ring",
    sequence_parallel: bool = False,
    sharding_level: int = 0,
    length: int = 30,
    impl: str = "eager",
    checkpointing: bool = False,
    steps: int = 3,
) -> dict:
    """The cp model and one device on the same batch (every dp replica gets it too, so averages are exact)."""
    import optimum_parallel as op
    from optimum_parallel.engine.compose import compose_training

    mesh = op.init_mesh(dp=dist.get_world_size() // (cp * tp), cp=cp, tp=tp)
    config = cp_config(model_type)
    reference = _reference(config, impl)
    reference.train() if checkpointing else reference.eval()
    model = copy.deepcopy(reference)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(
        model, sequence_parallel_enabled=sequence_parallel, context_parallel_strategy=strategy
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = compose_training(
        model, optimizer, mesh, {}, op.DataParallelConfig(sharding_level=sharding_level)
    )
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)

    batch = cp_batch(config, length)
    loss, ref_loss = model(**batch).loss, reference(**batch).loss
    loss.backward()
    ref_loss.backward()
    expected = dict(reference.named_parameters())
    grads = {}
    for name, param in model.named_parameters():
        layout = getattr(param, "shard_layout", None)
        full = expected[name].grad
        grads[name] = rel_err(_whole(param.grad), layout.slice(full) if layout is not None else full)
    worst = max(grads, key=grads.get)

    with torch.no_grad():
        logits, ref_logits = model(**batch).logits, reference(**batch).logits
    real = batch["attention_mask"].bool()
    real[0, :4] = False  # left padding and the token right after it (see cp_batch)

    losses = []
    for _ in range(steps):
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
        loss, ref_loss = model(**batch).loss, reference(**batch).loss
        loss.backward()
        ref_loss.backward()
        losses.append(rel_err(loss, ref_loss))
    return {
        "loss": rel_err(model(**batch).loss if steps == 0 else loss, ref_loss),
        "grad": grads[worst],
        "worst": worst,
        "grads": len(grads),
        "logits": rel_err(logits[real], ref_logits[real]),
        "logits_shape": tuple(logits.shape),
        "steps": max(losses, default=0.0),
    }


def _assert_exact(results: list[dict], length: int = 30) -> None:
    for rank, result in enumerate(results):
        assert result["logits_shape"][:2] == (2, length), result
        worst = max(result["loss"], result["grad"], result["logits"], result["steps"])
        assert worst <= TOL, f"rank {rank}: {result}"


@pytest.mark.parametrize(
    "model_type,cp",
    [(m, 2) for m in ("llama", "qwen2", "qwen3", "mistral", "gemma2")]
    + [(m, 4) for m in ("llama", "qwen3", "mistral", "gemma2")],
)
def test_matches_one_device(pool, model_type, cp):
    """dp=2 x cp=2 and cp=4; 30 tokens (padded to 32 inside); sliding windows and gemma2's soft cap."""
    _assert_exact(pool.run(check_context, model_type, cp=cp))


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_all_to_all_strategy(pool, impl):
    _assert_exact(pool.run(check_context, "llama", strategy="all_to_all", impl=impl))


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_composes_with_tensor_parallelism(pool, sequence_parallel):
    """cp=2 x tp=2: the ring runs over each tp rank's heads; the vocab-parallel loss sums over cp."""
    _assert_exact(pool.run(check_context, "llama", tp=2, sequence_parallel=sequence_parallel))


@pytest.mark.parametrize("sharding_level", [0, 1, 2, 3])
def test_composes_with_data_parallelism(pool, sharding_level):
    """dp=2 x cp=2: gradients averaged over dp x cp (DDP, ZeRO-1, FSDP2) give the one-device gradient."""
    _assert_exact(pool.run(check_context, "llama", sharding_level=sharding_level))


def test_activation_checkpointing_recomputes_the_ring(pool):
    _assert_exact(pool.run(check_context, "llama", checkpointing=True))


def _eager(q, k, v, visible, scale, softcap):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v


@pytest.mark.parametrize("window", [None, 5, 13])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("padded", [False, True])
def test_chunk_pairs_match_softmax_attention(window, softcap, padded):
    """One process holding all 8 chunks in the all-to-all order (0, 7, 1, 6, ...): output and gradients of the
    chunk-pair attention equal plain softmax attention over the whole sequence (fused and plain paths, GQA);
    rows that see no key give 0."""
    from optimum_parallel.context_parallel.blocks import Attend
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
    visible = (pos[None, :] <= pos[:, None])[None, None] & keys[:, None, None, :]
    if window is not None:
        visible = visible & (pos[:, None] - pos[None, :] < window)
    scale = d**-0.5
    sees = visible.any(-1, keepdim=True)
    expected = torch.where(sees, _eager(q, k, v, visible | ~sees, scale, softcap), 0.0)  # no NaN rows
    attend = Attend(chunk, scale, window, softcap, keys if padded else None)
    local = [t.detach()[:, :, index].requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, attend, lambda _: order, None)
    assert torch.allclose(out, expected[:, :, index], atol=1e-12)
    grad = torch.randn_like(expected).masked_fill(~sees, 0.0)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
    out.backward(grad[:, :, index])
    for mine, theirs in zip(local, expected_grads, strict=True):
        assert torch.allclose(mine.grad, theirs[:, :, index], atol=1e-10)


def check_pipeline_context(steps: int = 2) -> dict:
    """pp=2 x cp=2, two micro-batches holding different numbers of labelled tokens, against one process on the
    whole batch (the pipeline's loss is the token mean of the batch, not the mean of the micro-batch means)."""
    import optimum_parallel as op
    from optimum_parallel.data_parallel.levels import apply_data_parallel

    mesh = op.init_mesh(pp=2, cp=2)
    config = cp_config("llama", num_hidden_layers=4)
    reference = _reference(config, "eager").eval()
    model = copy.deepcopy(reference)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model, pipeline_parallel_num_microbatches=2)
    optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
    model, optimizer = apply_data_parallel(model, optimizer, mesh, op.DataParallelConfig())
    batch = cp_batch(config, rows=4)
    batch["labels"][2:, 20:] = -100  # the second micro-batch has fewer labelled tokens
    evaluated = model.run_eval(**batch)
    with torch.no_grad():
        ref_logits = reference(**batch).logits
    real = batch["attention_mask"].bool()
    real[0, :4] = False
    logits = rel_err(evaluated.logits[real], ref_logits[real]) if evaluated.logits is not None else 0.0
    ref_params = dict(reference.named_parameters())
    losses, grads = [], {}
    for step in range(steps):
        ref_loss = reference(**batch).loss
        ref_loss.backward()
        losses.append(rel_err(model.run_train(**batch), ref_loss))
        if step == 0:
            for name, param in model.named_parameters():
                grads[name] = rel_err(param.grad, ref_params[name].grad)
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
    return {"loss": max(losses), "grad": max(grads.values()), "grads": len(grads), "logits": logits}


def test_composes_with_pipeline_parallelism(pool):
    results = pool.run(check_pipeline_context)
    for rank, result in enumerate(results):
        assert max(result["loss"], result["grad"], result["logits"]) <= TOL, f"rank {rank}: {result}"
    assert all(r["grads"] for r in results)


def context_errors() -> dict[str, str]:
    import optimum_parallel as op

    op.init_mesh(cp=4)
    config = cp_config("llama")
    errors = {}

    def attempt(name, fn):
        try:
            fn()
        except (ValueError, NotImplementedError, RuntimeError) as err:
            errors[name] = f"{type(err).__name__}: {err}"
        else:
            errors[name] = "no error"

    def parallel(model_type="llama", strategy="ring", **overrides):
        model = _reference(cp_config(model_type, **overrides), "eager")
        return op.ParallelizersManager.parallelizer_for_model(model).parallelize(
            model, context_parallel_strategy=strategy
        )

    batch = cp_batch(config, length=16)
    # bad requests (family, strategy, all_to_all heads) raise before anything changes: tests/test_bad_requests.py
    attempt("no_reduction", lambda: parallel()(**batch))  # training without dp x cp gradient reduction
    with torch.no_grad():
        attempt("generate", lambda: parallel().generate(batch["input_ids"], max_new_tokens=2))
        mask4d = torch.ones(2, 1, 16, 16, dtype=torch.bool)
        attempt("mask", lambda: parallel()(input_ids=batch["input_ids"], attention_mask=mask4d))
        packed = torch.cat([torch.arange(8), torch.arange(8)]).expand(2, 16)  # packed rows: supported (test_packing)
        attempt("packed", lambda: parallel()(input_ids=batch["input_ids"], position_ids=packed))
    return errors


def test_errors_name_what_is_supported(pool):
    errors = pool.run(context_errors)[0]
    assert "generate() is not supported on a context-parallel model" in errors["generate"], errors
    assert "must be 2-D" in errors["mask"], errors
    assert errors["packed"] == "no error", errors
    assert "reduced over dp x cp" in errors["no_reduction"] and "dp_config" in errors["no_reduction"], errors


def test_long_context_example_runs_under_torchrun():
    import os
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "long_context.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", str(example)]
    command += ["--cp", "2", "--tp", "2", "--seq", "128", "--steps", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "step 1: loss" in result.stdout


def logits_to_keep_refused() -> list[str]:
    import optimum_parallel as op

    mesh = op.init_mesh(dp=dist.get_world_size() // 2, cp=2)
    model = build_model(tiny_config("llama"))
    model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(model)
    model, _ = op.parallelize(model, None, mesh, {"dp_config": {"sharding_level": 0}})
    batch = make_batch(tiny_config("llama"))
    messages = []
    for keep in (1, torch.tensor([3, 4])):
        try:
            with torch.no_grad():
                model(**batch, logits_to_keep=keep)
        except NotImplementedError as err:
            messages.append(str(err))
    return messages


def test_logits_to_keep_is_refused_naming_the_key(pool):
    """A forward keeping only the last positions' logits cannot be served from a rank's chunks: refused, naming
    the argument and the value that runs (0)."""
    for messages in pool.run(logits_to_keep_refused):
        assert len(messages) == 2 and all("logits_to_keep" in m and "allowed: 0" in m for m in messages), messages
