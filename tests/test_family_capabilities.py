"""Every hand-written family's declaration against what its model's structure allows (`derive_capabilities`): equal,
or stricter with the reason written down in the declaration (which the refusal then gives); never looser."""

from __future__ import annotations

import pytest
import torch
from test_families import AUTO, FAMILIES, TOKENS
from transformers import AutoConfig

import optimum_parallel as op
from optimum_parallel.autoplan.structure import derive_capabilities

TASKS = {"bert": "mlm", "roberta": "mlm", "t5": "s2s"}
LAYOUTS = {"sequence": "sequence_parallel", "pipeline": "pipeline_parallel", "context": "context_parallel"}
HAND_WRITTEN = [t for t in FAMILIES if op.ParallelizersManager.is_model_supported(t)]


@pytest.mark.parametrize("model_type", HAND_WRITTEN)
def test_declaration_is_the_structure_or_stricter_with_a_reason(model_type):
    config = AutoConfig.for_model(model_type, **{**TOKENS, **FAMILIES[model_type]})
    with torch.device("meta"):
        model = AUTO[TASKS.get(model_type, "causal")].from_config(config)
    family = op.ParallelizersManager.parallelizer_for_model(model)
    if family.capabilities_for.__func__ is not op.Parallelizer.capabilities_for.__func__:
        pytest.skip(f"{family.__name__} derives its capabilities from the structure")
    declared, derived = family.capabilities_for(model), derive_capabilities(model)
    for layout, field in LAYOUTS.items():
        allows, structure = getattr(declared, field), getattr(derived, field)
        assert not allows or structure, f"{model_type}: declares {layout} the structure refuses: {derived}"
        if structure and not allows:
            assert declared.reason(layout), (
                f"{model_type}: refuses {layout}, which its structure allows, saying why not"
            )
