"""Sequence parallelism (Megatron style, sequence dim 1) against the single-device model (gloo, 4 ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _checks import TOL, check_matches_reference, count_collectives, grad_errors
from _models import build_model, make_batch, rel_err, tiny_config

CASES = [
    ("llama", 2, {}, False),
    ("llama", 2, {}, True),
    ("llama", 4, {"num_key_value_heads": 1, "tie_word_embeddings": True}, True),
    ("mistral", 4, {"vocab_size": 130}, True),
    ("qwen2", 2, {}, True),
]


@pytest.mark.parametrize(
    "model_type,tp,overrides,sp", CASES, ids=[f"{m}-tp{t}-sp{int(sp)}-{i}" for i, (m, t, _, sp) in enumerate(CASES)]
)
def test_matches_single_device(pool, model_type, tp, overrides, sp):
    for rank, errors in enumerate(pool.run(check_matches_reference, model_type, tp, overrides, sp)):
        for key in ("logits", "loss", "worst_grad", "steps"):
            assert errors[key] <= TOL, f"rank {rank}: {key} relative error {errors[key]:.2e} ({errors})"


def test_sequence_parallel_communication(pool):
    """Per decoder layer 2 all-gathers + 2 reduce-scatters of the activation forward and no all-reduce;
    mirrored backward, where the only all-reduces are the norms' hidden-sized weight gradients."""
    config = tiny_config("llama")
    activation = 2 * 16 * config.hidden_size  # make_batch's batch x seq x hidden
    per_model = {}
    for layers in (1, 3):
        calls = pool.run(count_collectives, layers, 2, True)[0]
        counts = {}
        for phase, name, numel, _ in calls:
            kind = "activation" if numel in (activation, activation // 2) else numel
            counts[(phase, name, kind)] = counts.get((phase, name, kind), 0) + 1
        per_model[layers] = counts
    delta = {k: per_model[3].get(k, 0) - per_model[1].get(k, 0) for k in per_model[3] | per_model[1]}
    delta = {k: v for k, v in delta.items() if v}
    hidden = config.hidden_size
    assert delta == {
        ("forward", "all_gather", "activation"): 4,  # 2 layers more: 2 each
        ("forward", "reduce_scatter", "activation"): 4,
        ("backward", "reduce_scatter", "activation"): 4,
        ("backward", "all_gather", "activation"): 4,
        ("backward", "all_reduce", hidden): 4,  # input / post-attention norm weight gradients
    }, delta


def check_indivisible_sequence(tp: int) -> dict:
    """Sequence length 15 at tp=2: the forward leaves the sequence whole (the tensor-parallel path); loss,
    logits and every gradient still match the single-device model, in training mode."""
    import copy

    import optimum_parallel as op

    op.init_mesh(dp=dist.get_world_size() // tp, tp=tp)
    config = tiny_config("llama")
    reference = build_model(config)
    model = copy.deepcopy(reference)
    model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(model, sequence_parallel_enabled=True)
    batch = make_batch(config, seq=15)
    for m in (reference, model):
        m.train()
    expected, out = reference(**batch), model(**batch)
    expected.loss.backward()
    out.loss.backward()
    with torch.no_grad(), op.logits_mode(model, "full"):
        logits = rel_err(model(**batch).logits, expected.logits)
    grad = max(grad_errors(reference, model).values())
    return {"loss": rel_err(out.loss, expected.loss), "logits": logits, "grad": grad}


def test_indivisible_sequence_runs_the_tensor_parallel_path(pool):
    for rank, errors in enumerate(pool.run(check_indivisible_sequence, 2)):
        assert all(e <= TOL for e in errors.values()), f"rank {rank}: {errors}"
