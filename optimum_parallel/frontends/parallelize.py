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
from ..engine.data_parallel import DataParallelConfig
from ..engine.validate import CONFIG_KEYS
from ..mesh import ParallelMesh, get_mesh
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
    pipeline = None
    if parsed.pp_config is not None:
        pp = parsed.pp_config
        _check_global_spec(inner, pp)
        pipeline = PipelineRequest(pp.split_spec, pp.num_microbatches or mesh.size("pp"), pp.schedule)
    plan = parsed.mp_config.parallelize_plan if parsed.mp_config is not None else None
    # compose validates the whole request (plan, pipeline, cp, dp and optimizer) before it changes anything
    parallel, optimizer, _ = compose(
        inner,
        mesh,
        plan,
        pipeline=pipeline,
        optimizer=optimizer,
        data_parallel=_data_parallel(parsed, mesh),
        keys=CONFIG_KEYS,
    )
    return (model if inner is not model else parallel), optimizer


def _check_global_spec(model: nn.Module, config: PipelineParallelConfig) -> None:
    """This door's own key: every stage recomputes the module `global_spec` names (the decoder's rotary embedding)."""
    if config.global_spec is not None and config.global_spec not in dict(model.named_modules()):
        raise ValueError(
            f"pp_config['global_spec'] = {config.global_spec!r} names no module of {type(model).__name__}; "
            "allowed: a module name such as 'model.rotary_emb'"
        )


def _data_parallel(config: ParallelConfig, mesh: ParallelMesh) -> DataParallelConfig | None:
    """The dp_config, or level 0 on a mesh with cp > 1 or ep > 1: cp ranks' gradients are partial (each saw a share
    of the sequence), and ep ranks' expert gradients hold other ranks' tokens, so skipping data parallelism there
    would train every rank on its own."""
    if config.dp_config is None and (mesh.size("cp") > 1 or mesh.size("ep") > 1):
        return DataParallelConfig()
    return config.dp_config


def _resolve_mesh(mesh: ParallelMesh | None, config: ParallelConfig) -> ParallelMesh:
    if mesh is None:
        mesh = get_mesh()
    if not isinstance(mesh, ParallelMesh):
        raise TypeError(f"mesh must be a ParallelMesh (from optimum_parallel.init_mesh), got {type(mesh).__name__}")
    # dp_config acts on the ranks holding the same parameters: dp x cp of them; mp_config's plan splits over tp, or
    # only declares a custom model's experts for ep (the ExpertParallel style)
    declares_only = config.mp_config is not None and _only_expert_declarations(config.mp_config.parallelize_plan)
    needs = {
        "mp_config": (
            "tp > 1 (or ep > 1 for a plan of ExpertParallel styles only)",
            mesh.size("tp") if not declares_only else max(mesh.size("tp"), mesh.size("ep")),
        ),
        "dp_config": ("dp x cp > 1", mesh.data_parallel_size),
        "pp_config": ("pp > 1", mesh.size("pp")),
    }
    for key, (dims, size) in needs.items():
        if getattr(config, key) is not None and size == 1:
            sizes = ", ".join(f"{d}={s}" for d, s in mesh.sizes.items())
            raise ValueError(f"{key} needs a mesh with {dims}; the mesh has {sizes}")
    return mesh


def _only_expert_declarations(plan: Mapping | None) -> bool:
    """Whether every style of `plan` is `ExpertParallel` (it splits nothing over tp: it declares experts for ep)."""
    from ..styles import ExpertParallel, optional

    if not isinstance(plan, Mapping) or not plan:
        return False
    values = [value.styles if isinstance(value, optional) else value for value in plan.values()]
    styles = [style for value in values for style in (value if isinstance(value, (list, tuple)) else [value])]
    return all(isinstance(style, ExpertParallel) for style in styles)
