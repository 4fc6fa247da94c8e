"""The sharded data-parallel machinery both dense and expert data parallelism build on: ZeRO-1 (torch's
`ZeroRedundancyOptimizer`) and FSDP2 (`fully_shard`) units, block by block."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..plan.optimizer import rebuild_optimizer
from ..plan.parameters import mark_replaced
from .gradient_sync import average_after_backward


def replicate_model(model: nn.Module, group: dist.ProcessGroup, ignored_modules: list[nn.Module] | None = None) -> None:
    """Levels 0-1: torch's composable DDP over `group`. It looks for unused parameters after each forward, as
    transformers' Trainer decides for DDP (unless activation checkpointing is on: reentrant checkpointing and that
    search do not mix): a parameter that requires a gradient but never gets one (ERNIE 4.5 MoE's
    `e_score_correction_bias` once loaded by `from_pretrained`, which only picks the top-k experts; a VLM's vision
    layers past `vision_feature_layer`) would otherwise hold its bucket back, its neighbours' gradients would go
    unreduced and the replicas drift apart; found, it keeps no gradient, as on one device (measured 2-7% per step
    at dp=2 on a Llama of hidden 512)."""
    from torch.distributed._composable import replicate  # loaded here: importing the package stays light

    find_unused = not getattr(model, "is_gradient_checkpointing", True)
    replicate(model, process_group=group, ignored_modules=ignored_modules, find_unused_parameters=find_unused)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (decoder layers) FSDP wraps one by one, so one block is gathered at a time. A pipeline
    stage's are its decoder layers, however few: its other modules (a vision-language model's vision tower, which a
    micro-batch without images does not run) stay in the stage's own unit, gathered for every micro-batch alike on
    every replica."""
    from ..pipeline.stage import DecoderStage

    if isinstance(model, DecoderStage):
        return list(model.layers)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            return list(module)
    return []


def fully_shard_model(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    roots: list[nn.Module],
    dp_mesh,
    level: int,
    reduce_dtype: torch.dtype | None,
    small: list[nn.Parameter],
    small_group: dist.ProcessGroup,
    shard_first: Callable[[bool, object], None] | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Levels 2-3 with FSDP2: `shard_first(reshard_after_forward, policy)` makes its own units first (the experts on
    their replica mesh), then every block of each root and each root becomes a unit on `dp_mesh`. The `small`
    parameters stay whole and are all-reduced over `small_group` after the backward. FSDP2 makes new parameters:
    they keep the old ones' layouts, and the optimizer is rebuilt on them."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    before = dict(model.named_parameters(remove_duplicate=False))
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    reshard = level == 3
    if shard_first is not None:
        shard_first(reshard, policy)
    ignored = set(small)
    for root in roots:
        for block in blocks(root):
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy, ignored_params=ignored)
        fully_shard(root, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy, ignored_params=ignored)
    if small:
        average_after_backward(small, small_group)
    after = dict(model.named_parameters(remove_duplicate=False))
    for name, param in before.items():
        for attribute in ("shard_layout", "expert_layout"):
            if hasattr(param, attribute):
                setattr(after[name], attribute, getattr(param, attribute))
    replaced = [p for name, p in before.items() if after[name] is not p]
    mark_replaced(replaced, f"FSDP2 at sharding level {level} holds its own sharded parameters")
    if optimizer is not None:
        optimizer = rebuild_optimizer(optimizer, {id(p): after[name] for name, p in before.items()})
        if not reshard:
            reshard_before_step(optimizer, roots)
    return model, optimizer


def reshard_before_step(optimizer: torch.optim.Optimizer, roots: list[nn.Module]) -> None:
    """Level 2 keeps the weights gathered after a forward until a backward frees them: a no-grad forward between
    backward and step (metrics, evaluation) would leave them gathered, and the forward after the step would use
    the weights from before it. Dropping them before every step is free otherwise (the backward dropped them)."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for root in roots for m in root.modules() if isinstance(m, FSDPModule)]

    def reshard(*_) -> None:
        for module in sharded:
            module.reshard()

    optimizer.register_step_pre_hook(reshard)


def below_threshold(model: nn.Module, threshold_kb: float) -> list[nn.Parameter]:
    """The parameters smaller than `threshold_kb` KB (this rank's piece), in model order (the same on every rank):
    FSDP2 leaves them whole (replicated)."""
    if threshold_kb <= 0:
        return []
    limit = threshold_kb * 1024
    return [p for p in model.parameters() if p.numel() * p.element_size() < limit]


def zero1(
    optimizer: torch.optim.Optimizer, group: dist.ProcessGroup, param_groups: list[dict] | None = None
) -> torch.optim.Optimizer:
    """The same optimizer with its state sharded over `group` (param groups and hyper-parameters kept; or, given,
    `param_groups`: a part of them)."""
    if getattr(optimizer, "state", None):  # the request's validation refuses it; a direct call too
        raise ValueError("ZeRO-1 needs a fresh optimizer: this one already holds state, which cannot be re-partitioned")
    groups = [dict(group) for group in (optimizer.param_groups if param_groups is None else param_groups)]
    accepted = inspect.signature(type(optimizer)).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), process_group=group, **defaults)
