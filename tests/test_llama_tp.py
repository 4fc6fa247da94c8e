"""Llama-family tensor parallelism against the real single-device transformers model (gloo, 4 ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _models import build_model, make_batch, rel_err, tiny_config
from _pool import WorkerPool

TOL = 1e-5
STEPS = 3


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(4)
    yield p
    p.close()


def _reference_and_parallel(model_type: str, tp: int, overrides: dict):
    import optimum_parallel as op

    mesh = op.init_mesh(dp=dist.get_world_size() // tp, tp=tp)
    config = tiny_config(model_type, **overrides)
    reference = build_model(config)
    parallel = copy.deepcopy(reference)
    optimizer = torch.optim.AdamW(parallel.parameters(), lr=1e-2, weight_decay=0.1)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(parallel)
    parallel = parallelizer.parallelize(parallel)
    optimizer = parallelizer.optimizer_for_mp(optimizer, parallel.orig_param_to_parallel_param)
    return mesh, config, reference, parallel, optimizer


def check_matches_reference(model_type: str, tp: int, overrides: dict) -> dict:
    """Logits, loss, every gradient, then the loss over STEPS AdamW steps; returns the worst errors."""
    mesh, config, reference, parallel, optimizer = _reference_and_parallel(model_type, tp, overrides)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    batch = make_batch(config)

    ref_out = reference(**batch)
    ref_out.loss.backward()
    out = parallel(**batch)
    out.loss.backward()

    errors = {"logits": rel_err(parallel.lm_head.gather(out.logits), ref_out.logits),
              "loss": rel_err(out.loss, ref_out.loss)}
    ref_params = dict(reference.named_parameters())
    grads = {}
    for name, param in parallel.named_parameters():
        expected = ref_params[name].grad
        layout = getattr(param, "shard_layout", None)
        grads[name] = rel_err(param.grad, layout.slice(expected) if layout is not None else expected)
    errors["worst_grad"] = max(grads.values())
    errors["worst_grad_name"] = max(grads, key=grads.get)
    errors["n_params"] = len(grads)

    steps = []
    for _ in range(STEPS):
        ref_optimizer.step()
        optimizer.step()
        ref_optimizer.zero_grad()
        optimizer.zero_grad()
        ref_loss = reference(**batch).loss
        loss = parallel(**batch).loss
        ref_loss.backward()
        loss.backward()
        steps.append(rel_err(loss, ref_loss))
    errors["steps"] = max(steps)
    return errors


CASES = [
    ("llama", 2, {}),
    ("llama", 4, {"num_key_value_heads": 1}),  # kv head replicated over all 4 ranks
    ("llama", 2, {"tie_word_embeddings": True}),
    ("llama", 4, {"vocab_size": 130, "num_key_value_heads": 4}),  # vocab not divisible by tp
    ("mistral", 2, {}),
    ("mistral", 4, {}),  # 2 kv heads over 4 ranks
    ("qwen2", 2, {"tie_word_embeddings": True}),
    ("qwen2", 4, {"num_key_value_heads": 1}),  # q/k/v biases, replicated kv bias
]


@pytest.mark.parametrize("model_type,tp,overrides", CASES, ids=[f"{m}-tp{t}-{i}" for i, (m, t, _) in enumerate(CASES)])
def test_matches_single_device(pool, model_type, tp, overrides):
    for rank, errors in enumerate(pool.run(check_matches_reference, model_type, tp, overrides)):
        assert errors["n_params"] == len(dict(build_model(tiny_config(model_type, **overrides)).named_parameters()))
        for key in ("logits", "loss", "worst_grad", "steps"):
            assert errors[key] <= TOL, f"rank {rank}: {key} relative error {errors[key]:.2e} ({errors})"


def check_bad_tp_raises_before_moving_weights(tp: int) -> str:
    import optimum_parallel as op

    op.init_mesh(dp=dist.get_world_size() // tp, tp=tp)
    model = build_model(tiny_config("llama", num_attention_heads=2, num_key_value_heads=2, hidden_size=32))
    before = {n: p for n, p in model.named_parameters()}
    try:
        op.ParallelizersManager.parallelizer_for_model(model).parallelize(model)
    except ValueError as err:
        assert all(p is before[n] for n, p in model.named_parameters()), "weights moved before the error"
        return str(err)
    raise AssertionError("no error for tp not dividing the heads")


def test_tp_not_dividing_heads_is_rejected(pool):
    messages = pool.run(check_bad_tp_raises_before_moving_weights, 4)
    assert all("num_attention_heads=2" in m and "tensor_parallel_size=4" in m for m in messages)
