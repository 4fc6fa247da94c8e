"""Llama-family tensor parallelism against the real single-device transformers model (gloo, 4 ranks)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from _checks import TOL, check_matches_reference, count_collectives, grad_errors
from _models import build_model, make_batch, tiny_config

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


def test_megatron_minimal_communication(pool):
    """Per decoder layer exactly 2 all-reduces of batch*seq*hidden forward and 2 backward; the loss moves
    O(batch*seq) numbers and nothing ever moves batch*seq*vocab. Every backward all-reduce is asynchronous:
    it runs while the weight gradients of the layers behind it are computed."""
    config = tiny_config("llama")
    tokens = 2 * 16  # make_batch's batch x seq
    activation = tokens * config.hidden_size
    one, three = (pool.run(count_collectives, layers, 2)[0] for layers in (1, 3))
    for calls in (one, three):
        assert {name for _, name, _, _ in calls} == {"all_reduce"}
        assert max(n for _, _, n, _ in calls) <= activation < tokens * config.vocab_size
        loss_sized = [n for phase, _, n, _ in calls if n < activation]
        assert sorted(loss_sized) == [tokens, 2 * tokens], "loss: one max and one [target, sum-exp] all-reduce"
    for phase in ("forward", "backward"):
        per_model = [sum(1 for p, _, n, _ in calls if p == phase and n == activation) for calls in (one, three)]
        assert (per_model[1] - per_model[0]) == 2 * 2, f"{phase}: {per_model} all-reduces for 1 / 3 layers"
        assert per_model[0] == 2 + 1, f"{phase}: 2 per layer + 1 (embedding forward / LM-head input backward)"
    assert all(is_async for p, _, n, is_async in three if p == "backward" and n == activation)


def count_weight_grads_left_to_the_entry() -> int:
    """How many layers of a 1-layer Llama leave their weight gradient to the tp entry's backward."""
    import optimum_parallel as op
    from optimum_parallel.comm import tp_entry as region_entry

    op.init_mesh(dp=dist.get_world_size() // 2, tp=2)
    config = tiny_config("llama", num_hidden_layers=1)
    model = build_model(config)
    model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(model)
    batch = make_batch(config)
    counted, original = [], region_entry._LinearWithPendingWeightGrad.apply
    region_entry._LinearWithPendingWeightGrad.apply = lambda *args: counted.append(1) or original(*args)
    try:
        model(**batch).loss.backward()
    finally:
        region_entry._LinearWithPendingWeightGrad.apply = original
    return len(counted)


def check_gradient_checkpointing(reentrant: bool) -> float:
    """tp=2 under HF gradient checkpointing: the worst gradient error over two steps against the reference."""
    import copy

    import optimum_parallel as op

    op.init_mesh(dp=dist.get_world_size() // 2, tp=2)
    config = tiny_config("llama")
    reference = build_model(config)
    parallel = copy.deepcopy(reference)
    for model in (reference, parallel):
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    parallel = op.ParallelizersManager.parallelizer_for_model(parallel).parallelize(parallel)
    batch = make_batch(config)
    reference(**batch).loss.backward()
    worst = 0.0
    for _ in range(2):
        parallel.zero_grad()
        parallel(**batch).loss.backward()
        worst = max(worst, *grad_errors(reference, parallel).values())
    return worst


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing(pool, reentrant):
    """Activation checkpointing recomputes the forward in backward: the overlapped tp entry must save the same
    tensors both times (non-reentrant checkpointing checks it) and give the reference gradients."""
    for rank, worst in enumerate(pool.run(check_gradient_checkpointing, reentrant)):
        assert worst <= TOL, f"rank {rank}: worst gradient relative error {worst:.2e}"


def test_weight_gradients_overlap_the_entry_collective(pool):
    """Every column layer behind a shared entry (q, k, v; gate, up; the LM head) computes its weight gradient
    while the entry's all-reduce runs."""
    assert pool.run(count_weight_grads_left_to_the_entry) == [6] * 4
