"""Gradients averaged over the ranks that hold the same parameters, in one flat bucket: the one place the package
all-reduces gradients itself (dense data parallelism where torch's DDP does not run, the experts' own replicas, the
pipeline's data parallelism at levels 0-1, FSDP2's ignored small parameters).

Every path ends in `average_flat`: the gradients of a fixed parameter order (the same on every rank) cat into one
buffer, one all-reduce, divided by the group's size (the same on every rank: no value read on the host, so on XLA
the reduction is part of the step's graph, one program for every rank), copied back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..mesh import device as devices
from ..mesh import ranks


def average_flat(params: Sequence[torch.Tensor], group: dist.ProcessGroup, fill_missing: bool = False) -> None:
    """Average the `.grad` of `params` over `group` in one all-reduce. Parameters without a gradient are left out,
    or, with `fill_missing`, given zeros first (a rank whose experts got no token must still take part)."""
    if fill_missing:
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
    present = [p for p in params if p.grad is not None]
    if not present or ranks.world_size(group) == 1:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in present])
    dist.all_reduce(flat, group=group)
    flat /= ranks.world_size(group)
    for param, part in zip(present, flat.split([p.grad.numel() for p in present]), strict=True):
        if devices.is_graph_device(part):
            # a gradient of its own: copied into autograd's (often a transposed view of a buffer), the average
            # would be re-derived from that buffer, by a small graph of its own, at every read after a sync
            param.grad = part.view_as(param.grad).clone()
        else:
            param.grad.copy_(part.view_as(param.grad))


def average_after_backward(params: Sequence[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Average the gradients of `params` over `group` once per backward: the first gradient to arrive queues a
    callback that runs when the whole backward is done. Linear, so it stays right when gradients accumulate over
    micro-batches (it then runs once per micro-batch)."""
    ordered = list(params)  # one bucket layout on every rank
    run_after_backward(ordered, lambda: average_flat(ordered, group))


def run_after_backward(params: Sequence[nn.Parameter], callback: Callable[[], None]) -> None:
    """Run `callback` once at the end of every backward that reaches one of `params`."""
    queued = [False]

    def run() -> None:
        queued[0] = False
        callback()

    def on_gradient(_param: torch.Tensor) -> None:
        if not queued[0]:
            queued[0] = True
            torch.autograd.Variable._execution_engine.queue_callback(run)

    for param in params:
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(on_gradient)


def stage_gradient_averager(group: dist.ProcessGroup, keep: Callable[[nn.Parameter], bool]) -> Callable:
    """For a pipeline: average the gradients of the stages' parameters that `keep` selects over `group`, once after
    the whole batch (the schedule interleaves micro-batches, which DDP's reducer cannot follow)."""

    def average(stages: Sequence[nn.Module]) -> None:
        average_flat([p for stage in stages for p in stage.parameters() if keep(p)], group)

    return average
