"""`parallelize(model, optimizer, mesh, config)`: Paddle's front door, on the same engine as the Parallelizers.

Composition order (torchtitan's): pipeline split -> tensor/sequence parallel plan -> data parallel.
Everything is validated first (config, mesh, plan), so a bad call raises on every rank before any
module or parameter changes.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch
from torch import nn

from .config import ParallelConfig
from .data_parallel import apply_data_parallel
from .lazy import build_lazy_optimizer, is_lazy_optimizer, materialize_lazy_model
from .mesh import ParallelMesh, get_mesh
from .optimizer import rebuild_optimizer
from .plan import apply_plan, check_plan


def parallelize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    mesh: ParallelMesh | None = None,
    config: ParallelConfig | Mapping | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Make `model` (and `optimizer`) parallel over `mesh` (default: the one `init_mesh`/`set_mesh` set).

    config: {"dp_config": {"sharding_level": 0-3}, "mp_config": {"parallelize_plan": {...}},
    "pp_config": {"split_spec": ..., "global_spec": ...}} or a `ParallelConfig`.
    """
    parsed = ParallelConfig.parse(config)
    if parsed.empty:
        warnings.warn("parallelize: config has no dp_config, mp_config or pp_config; nothing to do", stacklevel=2)
        return model, optimizer
    mesh = _resolve_mesh(mesh, parsed)
    if parsed.pp_config is not None:
        raise NotImplementedError("pp_config: pipeline parallelism is not available yet")
    if parsed.mp_config is not None:
        check_plan(model, parsed.mp_config.parallelize_plan, mesh)

    if parsed.mp_config is not None:
        mapping = apply_plan(model, parsed.mp_config.parallelize_plan, mesh)
        materialize_lazy_model(model)
        if optimizer is not None:
            build = build_lazy_optimizer if is_lazy_optimizer(optimizer) else rebuild_optimizer
            optimizer = build(optimizer, mapping)
    if parsed.dp_config is not None:
        model, optimizer = apply_data_parallel(model, optimizer, mesh, parsed.dp_config)
    return model, optimizer


def _resolve_mesh(mesh: ParallelMesh | None, config: ParallelConfig) -> ParallelMesh:
    if mesh is None:
        mesh = get_mesh()
    if not isinstance(mesh, ParallelMesh):
        raise TypeError(f"mesh must be a ParallelMesh (from optimum_parallel.init_mesh), got {type(mesh).__name__}")
    needs = {"mp_config": "tp", "dp_config": "dp", "pp_config": "pp"}
    for key, dim in needs.items():
        if getattr(config, key) is not None and mesh.size(dim) == 1:
            sizes = ", ".join(f"{d}={s}" for d, s in mesh.sizes.items())
            raise ValueError(f"{key} needs a mesh with {dim} > 1; the mesh has {sizes}")
    return mesh
