"""plan_report / simulate_plan: a plan resolved for any tp on one process (meta model, no weights, no
process group), checked against the layouts the real parallel model gets on gloo ranks."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from test_auto_plan import auto_config
from test_families import family_config, save_tiny_model
from transformers import AutoConfig

import optimum_parallel as op
from optimum_parallel.memory_planner.report import plan_report
from optimum_parallel.memory_planner.simulate import simulate_plan


def test_report_from_a_saved_model_dir(tmp_path):
    config = family_config("llama", tie_word_embeddings=True, vocab_size=130)
    model_dir = save_tiny_model(tmp_path / "llama", config, "causal")
    report = plan_report(model_dir, 2)
    assert "LlamaForCausalLM (llama), tp=2, parallelizer LlamaParallelizer" in report
    assert "model.layers.*.self_attn.q_proj.weight" in report and "ColWiseParallel(units=4)" in report
    assert "model.layers.*.self_attn.k_proj.weight" in report and "dim 0: [0, 16) of 32" in report
    assert "lm_head.weight" in report and "dim 0: [0, 65) of 130" in report  # tied: its own row, one split
    # hidden 64, 2 layers, heads of 16, kv 2, intermediate 96, vocab 130 tied; rank 0 holds:
    layer = 32 * 64 + 2 * 16 * 64 + 64 * 32 + 3 * 48 * 64 + 2 * 64  # q, k, v, o, gate/up/down, 2 norms
    rank0 = 65 * 64 + 2 * layer + 64
    assert f"0     {rank0:,}" in report, report
    assert not dist.is_initialized(), "plan_report must not need a process group"


def test_report_errors_before_anything():
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide num_attention_heads=4"):
        plan_report(family_config("llama"), 3)
    with pytest.raises(ValueError, match="tp=0 is not allowed"):
        plan_report(family_config("llama"), 0)
    with pytest.raises(op.UnsupportedModelError, match="'bloom' is not supported"):
        plan_report(AutoConfig.for_model("bloom"), 2)


def test_report_for_an_automatic_plan():
    report = plan_report(auto_config("olmoe"), 2)
    assert "AutoPlanParallelizer[olmoe]" in report and "TensorParallelExperts" in report
    assert "model.layers.*.mlp.experts.gate_up_proj" in report and "2 packed parts" in report


CASES = [
    ("phi3", "causal", 4, {}),  # packed qkv with replicated kv parts
    ("qwen2_moe", "causal", 2, {}),
    ("gpt2", "causal", 4, {"vocab_size": 130}),
    ("bert", "mlm", 4, {}),
    ("t5", "s2s", 2, {}),
    ("olmo2", "causal", 4, {}),
]


def actual_layouts(model_dir: str, task: str, tp: int) -> tuple[int, dict, int]:
    """(tp rank, {name: layout} of the split parameters, local numel) of the real parallel model."""
    from test_families import load_model

    import optimum_parallel as op

    mesh = op.init_mesh(dp=dist.get_world_size() // tp, tp=tp)
    model = load_model(model_dir, task)
    model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(model)
    layouts = {n: p.shard_layout for n, p in model.named_parameters() if getattr(p, "shard_layout", None)}
    return mesh.tp_rank, layouts, sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model_type,task,tp,overrides", CASES, ids=[f"{m}-tp{t}" for m, _, t, _ in CASES])
def test_simulated_layouts_are_the_real_ones(pool, tmp_path, model_type, task, tp, overrides):
    config = auto_config(model_type) if model_type == "olmo2" else family_config(model_type, **overrides)
    model_dir = save_tiny_model(tmp_path / model_type, config, task)
    sim = simulate_plan(model_dir, tp)
    for rank, layouts, numel in pool.run(actual_layouts, model_dir, task, tp):
        split = {n: lay for n, lay in layouts.items() if lay.dim is not None}
        assert split and all(sim.layouts[rank].get(n) == lay for n, lay in split.items()), (rank, split)
        simulated = sum(
            p.numel() if (lay := sim.layouts[rank].get(n)) is None or lay.dim is None else _numel(lay.local_shape)
            for n, p in sim.model.named_parameters()
        )
        assert simulated == numel


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
