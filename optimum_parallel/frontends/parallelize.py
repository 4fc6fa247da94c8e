"""`parallelize(model, optimizer, mesh, config)`: Paddle's entry point, on the same engine as the Parallelizers.

The config is translated into one `ParallelRequest` (with its key names: `dp_config['sharding_level']`, ...),
which the engine validates whole (config values, mesh, plan, pipeline, data parallelism and optimizer) before it
changes anything, so a bad call raises on every rank with the model untouched.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch
from torch import nn

from ..engine.checks import validate
from ..engine.compose import compose
from ..engine.request import CONFIG_KEYS, ParallelRequest, PipelineSettings
from ..mesh import ParallelMesh, get_mesh
from ..plan.wrappers import plan_root
from .config import ParallelConfig


def parallelize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    mesh: ParallelMesh | None = None,
    config: ParallelConfig | Mapping | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Make `model` (and `optimizer`) parallel over `mesh` (default: the one `init_mesh`/`set_mesh` set).

    config: {"dp_config": {"sharding_level": 0-3}, "mp_config": {"parallelize_plan": {...}},
    "pp_config": {"split_spec": ..., "global_spec": ...}, "compile": True} or a `ParallelConfig` (`compile`: each
    decoder block through torch.compile, see `engine/compile.py`).
    The cp size lives in the mesh (`init_mesh(cp=...)`), not in the config; data parallelism runs over dp x cp,
    and on a mesh with cp > 1 it runs without a dp_config too (at sharding level 0), as the cp ranks must average
    their gradients.
    """
    parsed = ParallelConfig.parse(config)
    if parsed.empty:
        warnings.warn("parallelize: config has no dp_config, mp_config or pp_config; nothing to do", stacklevel=2)
        return model, optimizer
    mesh = get_mesh() if mesh is None else mesh
    inner = plan_root(model)  # the transformers model inside a PeftModel: plans name its modules
    checked = validate(config_request(parsed, optimizer), inner, mesh)
    composed = compose(inner, optimizer, mesh, checked)
    return (model if inner is not model else composed.model), composed.optimizer


def config_request(config: ParallelConfig, optimizer: torch.optim.Optimizer | None = None) -> ParallelRequest:
    """Paddle's config as one request (its sections named as `parallelize` names them)."""
    pipeline = None
    if config.pp_config is not None:
        pp = config.pp_config
        pipeline = PipelineSettings(pp.split_spec, pp.num_microbatches, pp.schedule, pp.global_spec)
    sections = tuple(name for name in ("mp_config", "dp_config", "pp_config") if getattr(config, name) is not None)
    return ParallelRequest(
        plan=config.mp_config.parallelize_plan if config.mp_config is not None else None,
        pipeline=pipeline,
        data_parallel=config.dp_config,
        optimizer=optimizer,
        sections=sections,
        shared_batch=config.shared_batch,
        compile=config.compile,
        keys=CONFIG_KEYS,
    )
