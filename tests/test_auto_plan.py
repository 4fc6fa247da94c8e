"""Automatic plans from `base_model_tp_plan`: families without a hand-written parallelizer, on real
gloo processes against the real single-device transformers model (same checks as test_families)."""

from __future__ import annotations

import pytest
import torch
from test_families import LLAMA_LIKE, TOKENS, assert_matches, check_family, make_inputs, save_tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

import optimum_parallel as op
from optimum_parallel.frontends.auto_plan import auto_parallelizer, translate_tp_plan, unsupported_entries
from optimum_parallel.styles import ReplicatedWithGradAllReduce, TensorParallelExperts

AUTO_FAMILIES = {
    # q/k/v gathered (q_norm/k_norm span all heads), o_proj splits its input: colwise_gather_output, rowwise_split_input
    "olmo2": dict(LLAMA_LIKE),
    # biases everywhere, c_fc/c_proj MLP, LayerNorm
    "starcoder2": dict(LLAMA_LIKE, use_bias=True),
    # MoE experts (packed_colwise + rowwise expert tensors, moe_tp_experts), q/k norms (replicated_with_grad_allreduce)
    "qwen3_moe": dict(
        LLAMA_LIKE, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1]
    ),
    # MoE experts with q/k/v gathered over tp (qwen3_moe has a hand-written parallelizer now: its plan is translated
    # in test_translation_of_a_moe_plan only)
    "olmoe": dict(LLAMA_LIKE, num_experts=4, num_experts_per_tok=2, intermediate_size=64),
    # partial rotary, dense/fc1/fc2 names, biases
    "phi": dict(LLAMA_LIKE, partial_rotary_factor=0.5),
    # embedding/residual/attention multipliers and logits scaling
    "granite": dict(
        LLAMA_LIKE, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0
    ),
}
CASES = [
    ("olmo2", 2, {}),
    ("olmo2", 4, {"num_key_value_heads": 4}),
    ("starcoder2", 2, {}),
    ("starcoder2", 4, {"vocab_size": 130}),  # 2 kv heads replicated over 4 ranks, uneven vocab
    ("olmoe", 2, {}),
    ("olmoe", 4, {"tie_word_embeddings": True}),
    ("phi", 2, {}),
    ("granite", 4, {"num_key_value_heads": 1, "tie_word_embeddings": True}),
]


def auto_config(model_type: str, **overrides):
    return AutoConfig.for_model(model_type, **{**TOKENS, **AUTO_FAMILIES[model_type], **overrides})


@pytest.mark.parametrize("model_type,tp,overrides", CASES, ids=[f"{m}-tp{t}-{i}" for i, (m, t, _) in enumerate(CASES)])
def test_auto_plan_matches_single_device(pool, tmp_path, model_type, tp, overrides):
    assert model_type not in op.ParallelizersManager.get_supported_model_types(include_auto=False)
    config = auto_config(model_type, **overrides)
    model_dir = save_tiny_model(tmp_path / model_type, config, "causal")
    results = pool.run(check_family, model_dir, "causal", tp, make_inputs(config, "causal"))
    assert results[0]["parallelizer"] == f"AutoPlanParallelizer[{model_type}]"
    assert_matches(results)


def test_hand_written_parallelizer_wins():
    for model_type in (
        "llama",
        "phi3",
        "qwen2_moe",
        "qwen3_moe",
        "gpt_neox",
    ):  # all of them carry a base_model_tp_plan too
        assert auto_parallelizer(model_type) is not None
        chosen = op.ParallelizersManager.parallelizer_for_model(model_type)
        assert not chosen.__name__.startswith("AutoPlan"), (model_type, chosen)


def test_supported_and_unsupported_plans():
    manager = op.ParallelizersManager
    assert manager.is_model_supported("olmo2") and manager.is_model_supported(auto_config("starcoder2"))
    assert "olmo2" in manager.get_supported_model_types()
    assert "olmo2" not in manager.get_supported_model_types(include_auto=False)
    # Nemotron-H's experts cut a plain up_proj colwise, a style this engine does not translate for expert tensors
    assert unsupported_entries(AutoConfig.for_model("nemotron_h").base_model_tp_plan)
    assert not manager.is_model_supported("nemotron_h")
    with pytest.raises(op.UnsupportedModelError, match=r"'nemotron_h' is not supported"):
        manager.parallelizer_for_model("nemotron_h")
    assert not manager.is_model_supported("bloom")  # no base_model_tp_plan, no parallelizer
    assert not manager.is_model_supported("doge")  # a plan that translates but trains wrongly here
    assert manager.is_model_supported("deepseek_v2") and manager.is_model_supported("apertus")  # test_moe_families


def test_translation_of_a_moe_plan():
    """Heads come from the attention block's head_dim; expert tensors become one TensorParallelExperts."""
    config = auto_config("qwen3_moe")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    plan = translate_tp_plan(model, config.base_model_tp_plan, r"model\.")
    styles = {key: value.styles for key, value in plan.items()}
    assert styles[r"model\.layers\.\d+\.self_attn\.q_proj"].units == 4
    assert styles[r"model\.layers\.\d+\.self_attn\.k_proj"].units == 2
    assert styles[r"model\.layers\.\d+\.self_attn\.o_proj"].units == 4
    assert isinstance(styles[r"model\.layers\.\d+\.self_attn\.q_norm"], ReplicatedWithGradAllReduce)
    experts = styles[r"model\.layers\.\d+\.mlp\.experts"]
    assert isinstance(experts, TensorParallelExperts)
    assert experts.packed == ("gate_up_proj",) and experts.row == ("down_proj",)
    assert r"model\.layers\.\d+\.mlp\.experts\.gate_up_proj" not in styles
    assert styles[r"model\.layers\.\d+\.mlp\.gate_proj"].units is None  # dense MLP: not heads
