"""Resolve, then check (issue 43): `resolve` decides every value the steps apply once (the compile config too) into a
frozen `ResolvedRequest`, `check` only reads it, a family entry point decides its family's part before the engine
resolves the request, and nothing in `engine/` calls a family. One process: a `SimulatedMesh` has the sizes and no
process groups, which is all that resolving and checking read."""

from __future__ import annotations

import ast
import dataclasses
from functools import partial
from pathlib import Path

import pytest
from _models import build_model, tiny_config

ENGINE = Path(__file__).resolve().parent.parent / "optimum_parallel" / "engine"
FAMILY_METHODS = {"family", "capabilities_for", "pipeline_split_spec", "parallelizer_for_model"}


def _llama():
    return build_model(tiny_config("llama"))


def _family(model):
    from optimum_parallel.frontends.manager import ParallelizersManager

    return ParallelizersManager.parallelizer_for_model(model)


def _mesh(tp=2, **sizes):
    from optimum_parallel.mesh import SimulatedMesh

    return SimulatedMesh(tp, sizes=sizes)


def _paddle_request(compile=True):
    """Paddle's entry point: the caller's plan, no family."""
    import optimum_parallel as op
    from optimum_parallel.frontends.config import ParallelConfig
    from optimum_parallel.frontends.parallelize import config_request

    plan = {"model.layers.*.mlp.gate_proj": op.ColWiseParallel(), "model.layers.*.mlp.down_proj": op.RowWiseParallel()}
    return config_request(ParallelConfig.parse({"mp_config": {"parallelize_plan": plan}, "compile": compile}))


@pytest.fixture
def compile_calls(monkeypatch):
    """How many times the caller's `compile` value is turned into a CompileConfig."""
    from optimum_parallel.engine import resolve

    calls = []
    real = resolve.compile_config

    def counting(value, key="compile"):
        calls.append(value)
        return real(value, key)

    monkeypatch.setattr(resolve, "compile_config", counting)
    return calls


def test_compile_config_is_made_once_per_validation(compile_calls):
    from optimum_parallel.engine.checks import validate
    from optimum_parallel.engine.compile import CompileConfig
    from optimum_parallel.frontends.family_request import family_request

    model = _llama()
    resolved = validate(_paddle_request(compile=True), model, _mesh())
    assert resolved.compile == CompileConfig() and len(compile_calls) == 1
    family = _family(model)
    resolved = validate(family.request(compile="inductor"), model, _mesh(), partial(family_request, family))
    assert resolved.compile == CompileConfig("inductor") and len(compile_calls) == 2


def test_resolved_request_is_frozen_and_what_compose_reads():
    from optimum_parallel.engine.checks import validate
    from optimum_parallel.engine.request import ResolvedRequest

    model = _llama()
    resolved = validate(_paddle_request(compile=False), model, _mesh())
    assert isinstance(resolved, ResolvedRequest)
    assert dataclasses.is_dataclass(resolved) and type(resolved).__dataclass_params__.frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.module_styles = None
    for name in ("request", "pipeline", "module_styles", "after_plan", "compile", "data_parallel", "capabilities"):
        assert hasattr(resolved, name), name  # engine/compose.py and the Trainer read these
    assert sorted(resolved.module_styles) == [
        f"model.layers.{i}.mlp.{p}" for i in (0, 1) for p in ("down_proj", "gate_proj")
    ]
    assert resolved.compile is None and resolved.pipeline is None and resolved.after_plan is None


def test_a_family_parallelizer_resolves_the_family_part_before_the_engine():
    """The family's plan, capabilities, fix-up and pipeline split arrive as values; the engine fills the defaults."""
    from optimum_parallel.engine.resolve import resolve
    from optimum_parallel.frontends.family_request import family_request

    model, mesh = _llama(), _mesh(tp=1, pp=2)
    family = _family(model)
    request = family_request(family, family.request(pipeline_parallel_num_microbatches=None), model, mesh)
    assert request.plan is not None and request.capabilities == family.capabilities_for(model)
    assert request.after_plan == family.after_plan and request.pipeline.split_spec == "model.layers"
    resolved = resolve(request, model, mesh)
    assert resolved.pipeline.num_microbatches == 2  # the default: pp
    assert resolved.capabilities == request.capabilities and resolved.after_plan == family.after_plan


def test_no_engine_module_calls_a_family_or_imports_the_entry_points():
    found = []
    for path in sorted(ENGINE.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in FAMILY_METHODS:
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.ImportFrom) and "frontends" in (node.module or ""):
                found.append(f"{path.name}:{node.lineno} imports {node.module}")
            if isinstance(node, ast.arg) and node.arg == "family":
                found.append(f"{path.name}:{node.lineno} takes a family")
    assert not found, "engine/ reaches into a family:\n" + "\n".join(found)


def _snapshot(model):
    """The parameter objects and module types: what a refused request must leave as they were."""
    return [(n, id(p)) for n, p in model.named_parameters()], [type(m) for m in model.modules()]


def test_a_capability_refusal_keeps_its_message_and_order():
    """gpt2 has no sequence-parallel plan: the refusal names the key and the allowed value, comes after the settings
    checks and before the family's own check, and the model is untouched."""
    from optimum_parallel.engine.checks import validate
    from optimum_parallel.frontends.family_request import family_request

    model = build_model(tiny_config("gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64))
    family = _family(model)
    before = _snapshot(model)
    with pytest.raises(NotImplementedError) as refused:
        validate(family.request(sequence_parallel_enabled=True), model, _mesh(), partial(family_request, family))
    message = str(refused.value)
    assert "sequence_parallel_enabled=True is not supported" in message
    assert "does not support sequence parallelism" in message and "allowed for this model: False" in message

    class Refusing(family):  # the family's own check runs after the capability refusal
        @classmethod
        def check(cls, model, mesh):
            raise ValueError("the family's check")

    with pytest.raises(NotImplementedError, match="allowed for this model: False"):
        validate(Refusing.request(sequence_parallel_enabled=True), model, _mesh(), partial(family_request, Refusing))
    with pytest.raises(ValueError, match="the family's check"):
        validate(Refusing.request(), model, _mesh(), partial(family_request, Refusing))
    with pytest.raises(ValueError, match=r"sequence_parallel_enabled='yes' is not allowed; allowed: True, False"):
        validate(Refusing.request(sequence_parallel_enabled="yes"), model, _mesh(), partial(family_request, Refusing))
    assert _snapshot(model) == before
