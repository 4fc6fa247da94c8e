"""MoE plans resolved on one process (no process group): how gpt_oss's biases and attention sinks are cut, the
automatic plans' sequence-parallel entries, and the errors that name what does not fit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from _models import tiny_config
from test_expert_parallel import MOE
from transformers import AutoConfig, AutoModelForCausalLM

from optimum_parallel.memory_planner.simulate import resolve_for_tp
from optimum_parallel.styles import SequenceParallelDisable, SplitParameter


def meta_model(model_type: str, **overrides):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(model_type, **{**MOE[model_type], **overrides}))


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt_oss_cuts_biases_in_whole_pairs_and_sinks_in_heads(tp):
    resolved = resolve_for_tp(meta_model("gpt_oss"), tp, sequence_parallel_enabled=True)
    experts = "model.layers.1.mlp.experts."
    pairs = 64 // tp  # intermediate_size 64: gate_up_proj [4, 64, 128] interleaved gate0, up0, gate1, up1...
    for rank, layouts in enumerate(resolved.layouts):
        cut = ((2 * pairs * rank, 2 * pairs * (rank + 1)),)
        assert layouts[experts + "gate_up_proj"].ranges == cut and layouts[experts + "gate_up_proj"].dim == 2
        assert layouts[experts + "gate_up_proj_bias"].ranges == cut and layouts[experts + "gate_up_proj_bias"].dim == 1
        assert layouts[experts + "down_proj_bias"].dim is None  # whole, added once
        heads = 4 // tp
        assert layouts["model.layers.0.self_attn.sinks"].ranges == ((heads * rank, heads * (rank + 1)),)
        assert layouts["model.layers.0.self_attn.q_proj.bias"].ranges == ((16 * heads * rank, 16 * heads * (rank + 1)),)


def test_deepseek_v3_dense_first_layer_gets_its_own_sequence_parallel_entry():
    resolved = resolve_for_tp(meta_model("deepseek_v3"), 2, sequence_parallel_enabled=True)
    dense, moe = resolved.targets["model.layers.0.mlp"], resolved.targets["model.layers.1.mlp"]
    assert [type(s) for s in dense] == [SequenceParallelDisable] and not dense[0].replicate  # reduce-scatter out
    # shared experts beside experts: replicated work (after a hook giving flattened tokens their [batch, seq] shape)
    assert [type(s) for s in moe][-1:] == [SequenceParallelDisable] and moe[-1].replicate


def test_errors_name_what_does_not_fit():
    with pytest.raises(ValueError, match=r"9 interleaved gate/up pairs .* tp must divide 9"):
        resolve_for_tp(meta_model("gpt_oss", intermediate_size=9), 2)
    model = meta_model("gpt_oss")
    plan = {r"model\.layers\.0\.self_attn": SplitParameter("sink", units=4)}
    with pytest.raises(ValueError, match=r"no parameter 'sink' .* allowed: its own parameters \['sinks'\]"):
        resolve_for_tp(model, 2, plan)
    plan = {r"model\.layers\.0\.self_attn": SplitParameter("sinks", units=4)}
    with pytest.raises(ValueError, match=r"sinks.*4 heads cannot be split over tensor-parallel size 3"):
        resolve_for_tp(model, 3, plan)


def test_automatic_plans_take_what_their_structure_allows():
    """sp / pp / cp of an automatic plan come from the model's layers (autoplan/structure.py), not from a list of
    types: a Llama-shaped MoE takes all three, so does Jamba (its Mamba mixers run under cp through mixers/); a
    mixer whose decoder builds no mask the cp layout can travel in blocks cp, naming its layer and class."""
    import optimum_parallel as op

    for model_type in ("olmoe", "granitemoe", "deepseek_v3", "phimoe"):
        model = meta_model(model_type)
        found = op.ParallelizersManager.parallelizer_for_model(model).capabilities_for(model)
        assert found.sequence_parallel and found.pipeline_parallel and found.context_parallel, (model_type, found)
    from family_matrix import family_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(family_config("jamba"))
    found = op.ParallelizersManager.parallelizer_for_model(model).capabilities_for(model)
    assert found.sequence_parallel and found.pipeline_parallel and found.context_parallel, found  # mixers/ runs it
    from optimum_parallel.mixers import marker

    namespace = marker._namespace(model.model)
    builder = namespace.pop(marker.MASK_FUNCTION)  # as a decoder that builds its mixers' mask some other way
    try:
        found = op.ParallelizersManager.parallelizer_for_model(model).capabilities_for(model)
    finally:
        namespace[marker.MASK_FUNCTION] = builder
    assert not found.context_parallel and "model.layers.0.mamba (JambaMambaMixer)" in found.reason("context"), found


def test_sparse_attention_indexers_refuse_context_parallelism_by_name():
    """DeepSeek sparse attention's indexer picks keys over the whole sequence beside the attention; DeepSeek-V4's
    compressor pools windows of it: the context-parallel attention computes neither, so cp is refused naming them."""
    import optimum_parallel as op
    from optimum_parallel.autoplan.structure import _inner_mixer

    sys.path.insert(0, str(Path(__file__).parent / "families"))
    from family_matrix import family_config
    from test_moe_families import TINY_CONFIGS

    for model_type in ("deepseek_v32", "glm_moe_dsa"):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **TINY_CONFIGS[model_type]))
        found = op.ParallelizersManager.parallelizer_for_model(model).capabilities_for(model)
        assert not found.context_parallel and "self_attn" in found.reason("context"), found
        assert "holds indexer" in found.reason("context"), found
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(family_config("deepseek_v4"))
    assert [_inner_mixer(layer.self_attn)[0] for layer in model.model.layers] == ["compressor", "compressor"]
