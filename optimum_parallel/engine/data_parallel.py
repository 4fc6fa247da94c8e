"""Data parallelism over the ranks that hold the same parameters (the mesh's dp x cp ranks), with Paddle's sharding
levels, on torch's own machinery.

level 0: parameters replicated, gradients all-reduced (composable DDP, `replicate`);
level 1: + optimizer state sharded (ZeRO-1, `ZeroRedundancyOptimizer`);
level 2: + gradients sharded (FSDP2 `fully_shard`, parameters kept gathered between forward and backward);
level 3: + parameters sharded (FSDP2, resharded after forward).
Tensor-parallel shards are plain local tensors, so every level composes with tp on a dp x tp mesh.
Context parallelism (cp) splits the sequence, not the weights, and scales each cp rank's loss by cp: averaging the
gradients over dp x cp (`mesh.data_parallel_group` / `data_parallel_mesh`) gives the single-device gradient.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed._composable import replicate
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer

from ..context_parallel import mark_gradients_reduced
from ..mesh import ParallelMesh
from ..plan.wrappers import plan_root
from ..state import parallel_state
from .optimizer import rebuild_optimizer

SHARDING_LEVELS = (0, 1, 2, 3)


def check_sharding_level(level: object, key: str = "sharding_level") -> None:
    """`level` is one of `SHARDING_LEVELS`; the error names `key` (the caller's name for it) and the allowed ones."""
    if isinstance(level, bool) or level not in SHARDING_LEVELS:
        raise ValueError(f"{key}={level!r} is not allowed; allowed: {', '.join(map(str, SHARDING_LEVELS))}")


def check_data_parallel(
    config: DataParallelConfig, optimizer: torch.optim.Optimizer | None, key: str = "sharding_level"
) -> None:
    """What `apply_data_parallel` needs of its request, checked before anything changes: the level, and for ZeRO-1
    an optimizer with no state yet (its state cannot be re-partitioned)."""
    check_sharding_level(config.sharding_level, key)
    if config.sharding_level == 1 and optimizer is not None and getattr(optimizer, "state", None):
        raise ValueError(
            f"{key}=1 (ZeRO-1) needs a fresh optimizer: this one already holds state, which cannot be re-partitioned "
            "here; allowed: an optimizer that has not stepped yet, or sharding_level 0, 2, 3"
        )


@dataclass
class DataParallelConfig:
    """`dp_config`: sharding_level 0-3; reduce_dtype e.g. torch.float32 to reduce bf16 gradients in fp32 (FSDP)."""

    sharding_level: int = 0
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        check_sharding_level(self.sharding_level, "dp_config['sharding_level']")
        if self.reduce_dtype is not None and not isinstance(self.reduce_dtype, torch.dtype):
            raise ValueError(f"dp_config['reduce_dtype'] = {self.reduce_dtype!r} is not a torch.dtype")


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (decoder layers) FSDP wraps one by one, so one block is gathered at a time."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            return list(module)
    return []


def apply_data_parallel(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    mesh: ParallelMesh,
    config: DataParallelConfig,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Make `model` (already tensor-parallel, or not) data-parallel over `mesh`'s dp x cp ranks; rebuild `optimizer`.
    Nothing to do when dp x cp is 1."""
    if mesh.data_parallel_size == 1:
        return model, optimizer
    mark_gradients_reduced(model)
    # Under pp the schedule calls the stage modules, not the model: the stages are the wrapped roots.
    pipeline = parallel_state(plan_root(model)).pipeline
    roots = list(pipeline.stages) if pipeline is not None else [model]
    if pipeline is not None:
        pipeline.use_data_parallelism(mesh, all_reduce_gradients=config.sharding_level <= 1)
    if config.sharding_level <= 1:
        if pipeline is None:
            replicate(model, process_group=mesh.data_parallel_group)
        if optimizer is not None and config.sharding_level == 1:
            optimizer = _zero1(optimizer, mesh)
        return model, optimizer

    before = dict(model.named_parameters(remove_duplicate=False))
    dp_mesh = mesh.data_parallel_mesh
    policy = MixedPrecisionPolicy(reduce_dtype=config.reduce_dtype)
    reshard = config.sharding_level == 3
    for root in roots:
        for block in _blocks(root):
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
        fully_shard(root, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    after = dict(model.named_parameters(remove_duplicate=False))
    for name, param in before.items():  # FSDP2 makes new parameters: keep their tensor-parallel layouts
        if hasattr(param, "shard_layout"):
            after[name].shard_layout = param.shard_layout
    if optimizer is not None:
        optimizer = rebuild_optimizer(optimizer, {id(p): after[name] for name, p in before.items()})
        if not reshard:
            _reshard_before_step(optimizer, roots)
    return model, optimizer


def _reshard_before_step(optimizer: torch.optim.Optimizer, roots: list[nn.Module]) -> None:
    """Level 2 keeps the weights gathered after a forward until a backward frees them: a no-grad forward between
    backward and step (metrics, evaluation) would leave them gathered, and the forward after the step would use
    the weights from before it. Dropping them before every step is free otherwise (the backward dropped them)."""
    sharded = [m for root in roots for m in root.modules() if isinstance(m, FSDPModule)]

    def reshard(*_) -> None:
        for module in sharded:
            module.reshard()

    optimizer.register_step_pre_hook(reshard)


def _zero1(optimizer: torch.optim.Optimizer, mesh: ParallelMesh) -> ZeroRedundancyOptimizer:
    """The same optimizer with its state sharded over dp x cp (param groups and hyper-parameters kept)."""
    check_data_parallel(DataParallelConfig(sharding_level=1), optimizer)
    groups = [dict(group) for group in optimizer.param_groups]
    accepted = inspect.signature(type(optimizer)).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
    return ZeroRedundancyOptimizer(
        groups, optimizer_class=type(optimizer), process_group=mesh.data_parallel_group, **defaults
    )
