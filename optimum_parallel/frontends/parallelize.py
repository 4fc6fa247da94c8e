"""`parallelize(model, optimizer, mesh, config)`: Paddle's front door, on the same engine as the Parallelizers.

The config becomes a plan, a pipeline request and a data-parallel config for `engine.compose`, which runs
the steps in their one order. Everything is validated first (config, mesh, plan), so a bad call raises on
every rank before any module or parameter changes.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch
from torch import nn

from ..engine.compose import PipelineRequest, compose
from ..engine.data_parallel import DataParallelConfig, check_shard_size
from ..mesh import ParallelMesh, get_mesh
from ..pipeline import SCHEDULES
from ..pipeline.split import find_layer_list, stage_layers
from ..plan import check_plan
from ..plan.wrappers import plan_root
from .config import ParallelConfig, PipelineParallelConfig


def parallelize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    mesh: ParallelMesh | None = None,
    config: ParallelConfig | Mapping | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Make `model` (and `optimizer`) parallel over `mesh` (default: the one `init_mesh`/`set_mesh` set).

    config: {"dp_config": {"sharding_level": 0-3}, "mp_config": {"parallelize_plan": {...}},
    "pp_config": {"split_spec": ..., "global_spec": ...}} or a `ParallelConfig`.
    The cp size lives in the mesh (`init_mesh(cp=...)`), not in the config; data parallelism runs over dp x cp,
    and on a mesh with cp > 1 it runs without a dp_config too (at sharding level 0), as the cp ranks must average
    their gradients.
    """
    parsed = ParallelConfig.parse(config)
    if parsed.empty:
        warnings.warn("parallelize: config has no dp_config, mp_config or pp_config; nothing to do", stacklevel=2)
        return model, optimizer
    mesh = _resolve_mesh(mesh, parsed)
    inner = plan_root(model)  # the transformers model inside a PeftModel: plans name its modules
    if parsed.pp_config is not None:
        _check_pipeline_config(inner, parsed.pp_config, mesh)
    if parsed.mp_config is not None:
        check_plan(inner, parsed.mp_config.parallelize_plan, mesh)

    pipeline = None
    if parsed.pp_config is not None:
        pp = parsed.pp_config
        pipeline = PipelineRequest(pp.split_spec, pp.num_microbatches or mesh.size("pp"), pp.schedule)
    plan = parsed.mp_config.parallelize_plan if parsed.mp_config is not None else None
    parallel, optimizer, _ = compose(
        inner, mesh, plan, pipeline=pipeline, optimizer=optimizer, data_parallel=_data_parallel(parsed, mesh)
    )
    return (model if inner is not model else parallel), optimizer


def _check_pipeline_config(model: nn.Module, config: PipelineParallelConfig, mesh: ParallelMesh) -> None:
    split = config.split_spec
    prefix = split if isinstance(split, str) else next(iter(split), "").rpartition(".")[0]
    stages = mesh.size("pp") * SCHEDULES[config.schedule][1]
    stage_layers(len(find_layer_list(model, prefix)), stages, split, prefix)
    if config.num_microbatches is not None and config.num_microbatches < mesh.size("pp"):
        raise ValueError(f"pp_config['num_microbatches'] = {config.num_microbatches} must be >= pp={mesh.size('pp')}")
    if config.global_spec is not None and config.global_spec not in dict(model.named_modules()):
        raise ValueError(f"pp_config['global_spec'] = {config.global_spec!r} names no module of {type(model).__name__}")


def _data_parallel(config: ParallelConfig, mesh: ParallelMesh) -> DataParallelConfig | None:
    """The dp_config, or level 0 on a mesh with cp > 1: cp ranks' gradients are partial (each saw a share of the
    sequence), so skipping data parallelism there would train every cp rank on its own."""
    if config.dp_config is None and mesh.size("cp") > 1:
        return DataParallelConfig()
    return config.dp_config


def _resolve_mesh(mesh: ParallelMesh | None, config: ParallelConfig) -> ParallelMesh:
    if mesh is None:
        mesh = get_mesh()
    if not isinstance(mesh, ParallelMesh):
        raise TypeError(f"mesh must be a ParallelMesh (from optimum_parallel.init_mesh), got {type(mesh).__name__}")
    # dp_config acts on the ranks holding the same parameters: dp x cp of them
    needs = {"mp_config": ("tp", mesh.size("tp")), "dp_config": ("dp x cp", mesh.data_parallel_size)}
    needs["pp_config"] = ("pp", mesh.size("pp"))
    for key, (dims, size) in needs.items():
        if getattr(config, key) is not None and size == 1:
            sizes = ", ".join(f"{d}={s}" for d, s in mesh.sizes.items())
            raise ValueError(f"{key} needs a mesh with {dims} > 1; the mesh has {sizes}")
    if config.dp_config is not None:  # before anything changes, as every other check
        check_shard_size(config.dp_config.shard_size, mesh.data_parallel_size)
    return mesh
