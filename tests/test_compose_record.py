"""The record `compose` returns (engine/runtime.py): frozen, it says what was installed (tp + sp, pp, cp), and a
second composition of the same model reads it instead of installing the packing hook and the guards again (gloo,
2 ranks)."""

from __future__ import annotations

import dataclasses
import functools

import torch
from _models import build_model, make_batch, tiny_config

WORLD_SIZE = 2
INSTALLED_ONCE = (
    "optimum_parallel.packing.hook",
    "optimum_parallel.data_parallel.shared_batch",
    "optimum_parallel.data_parallel.replica_watch",
)


def _once_hooks(model) -> list[str]:
    """The forward hooks on `model` from the `packing` package and the guards, by module."""
    hooks = [*model._forward_pre_hooks.values(), *model._forward_hooks.values()]
    functions = [h.func if isinstance(h, functools.partial) else h for h in hooks]
    return sorted(f.__module__ for f in functions if f.__module__ in INSTALLED_ONCE)


def record_tp_sp() -> dict:
    import optimum_parallel as op
    from optimum_parallel.styles.base import COLUMN, ROW

    op.init_mesh(tp=2)
    model = build_model(tiny_config("llama"))
    model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(model, sequence_parallel_enabled=True)
    record = op.parallel_state(model).runtime
    try:
        record.packing = False
        frozen = False
    except dataclasses.FrozenInstanceError:
        frozen = True
    return {
        "frozen": frozen,
        "model": record.model is model,
        "layers": set(record.tensor_parallel_layers.values()) == {COLUMN, ROW},
        "sequence": record.sequence is not None,
        "installed": (record.packing, record.guarded),
        "absent": (record.pipeline, record.context_parallel, record.expert_parallel, record.compile, record.optimizer),
        "param_map": len(record.param_map) > 0 and all(v is not None for v in record.param_map.values()),
        "hooks": _once_hooks(model),
    }


def record_pp() -> dict:
    import optimum_parallel as op

    op.init_mesh(pp=2)
    model = build_model(tiny_config("llama"))
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model, pipeline_parallel_num_microbatches=2)
    record = op.parallel_state(model).runtime
    return {
        "pipeline": record.pipeline is op.parallel_state(model).pipeline and len(record.pipeline.stages) == 1,
        "installed": (record.packing, record.guarded),  # the pipeline's batch functions lay packed rows out
        "other_stage": any(v is None for v in record.param_map.values()),  # the other rank's layers map to None
        "context_parallel": record.context_parallel,
    }


def record_cp() -> dict:
    import optimum_parallel as op

    op.init_mesh(cp=2)
    model = build_model(tiny_config("llama"))
    model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(model)
    record = op.parallel_state(model).runtime
    return {
        "context_parallel": record.context_parallel is op.parallel_state(model).context_parallel,
        "installed": (record.packing, record.guarded),  # cp's input split lays packed rows out itself
        "pipeline": record.pipeline,
    }


def compose_twice() -> dict:
    """The Parallelizer's composition, then `parallelize`'s data parallelism on the same model."""
    import optimum_parallel as op
    import optimum_parallel.frontends.parallelize as entry

    mesh = op.init_mesh(dp=2)
    config = tiny_config("llama")
    model = build_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(model)
    first = op.parallel_state(model).runtime
    hooks = _once_hooks(model)
    returned, compose = [], entry.compose
    entry.compose = lambda *args: returned.append(compose(*args)) or returned[-1]  # `parallelize` returns (model, opt)
    try:
        parallel, optimizer = op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": 0}})
    finally:
        entry.compose = compose
    second = op.parallel_state(model).runtime
    loss = parallel(**make_batch(config)).loss
    return {
        "first": (first.packing, first.guarded),
        "second": (second is not first, second.packing, second.guarded),
        "hooks": (hooks, _once_hooks(model)),
        "returned": (returned[0].model is parallel, returned[0].optimizer is optimizer),
        "data_parallel_level": (returned[0].data_parallel_level, second.data_parallel_level),
        "loss": bool(torch.isfinite(loss)),
    }


def test_tp_sp_record(pool):
    for facts in pool.run(record_tp_sp):
        assert facts["frozen"] and facts["model"] and facts["layers"] and facts["sequence"] and facts["param_map"]
        assert facts["installed"] == (True, True)
        assert facts["absent"] == (None, None, None, None, None)
        shared_batch, packing, replicas = INSTALLED_ONCE[1], INSTALLED_ONCE[0], INSTALLED_ONCE[2]
        assert facts["hooks"] == sorted([packing, shared_batch, replicas])


def test_pp_record(pool):
    for facts in pool.run(record_pp):
        assert facts == {"pipeline": True, "installed": (False, True), "other_stage": True, "context_parallel": None}


def test_cp_record(pool):
    for facts in pool.run(record_cp):
        assert facts == {"context_parallel": True, "installed": (False, True), "pipeline": None}


def test_second_compose_installs_nothing_twice(pool):
    for facts in pool.run(compose_twice):
        assert facts["first"] == (True, True)
        assert facts["second"] == (True, True, True)
        before, after = facts["hooks"]
        assert before and before == after, f"installed again: {before} -> {after}"
        assert facts["returned"] == (True, True)
        # compose's record says data parallelism ran; the model's record is its model half's (level None)
        assert facts["data_parallel_level"] == (0, None)
        assert facts["loss"]
