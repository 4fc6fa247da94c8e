"""Autograd-aware communication for tensor (and sequence) parallel regions.

Megatron's conjugate pairs, each an autograd.Function over one process group:
copy (identity / all-reduce), reduce (all-reduce / identity), scatter (split / all-gather),
gather (all-gather / split), and the sequence-dim pair all-gather / reduce-scatter.
The collectives themselves are `collectives.py`'s (torch.distributed, or shared memory for the ranks of one host;
tests count both; on XLA devices a rank's slice is taken with indices that reach the device as data, so every rank
runs the same compiled graph). Traced by torch.compile, each region op is the custom op of `compiled.py` instead
(one graph node, the same transports).
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from . import compiled
from .collectives import all_gather, all_reduce, reduce_scatter, split

SEQ_DIM = 1  # activations are [batch, seq, hidden]: sequence parallelism splits dim 1


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        if not x.is_contiguous():
            return all_reduce(x, group)  # .contiguous() already made a fresh tensor
        ctx.mark_dirty(x)  # in place: the partial sums are a temporary nobody else holds
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, sizes):
        ctx.dim, ctx.group, ctx.sizes = dim, group, sizes
        return split(x, dim, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.dim, ctx.group, ctx.sizes), None, None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, sizes):
        ctx.dim, ctx.group, ctx.sizes = dim, group, sizes
        return all_gather(x, dim, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return split(grad, ctx.dim, ctx.group, ctx.sizes), None, None, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.dim, ctx.group), None, None


def copy_to_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (entry of a column-parallel block)."""
    if torch.compiler.is_compiling():
        return compiled.enter(x, compiled.group_name(group)) if x.requires_grad else x
    if not torch.is_grad_enabled():  # inference: no autograd node to build (a decode step calls these a lot)
        return x
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-reduce forward; identity backward (exit of a row-parallel block)."""
    if torch.compiler.is_compiling():
        return compiled.reduce(x, compiled.group_name(group))
    if not torch.is_grad_enabled():
        return all_reduce(x, group)
    return _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_parallel_region(
    x: torch.Tensor, group: ProcessGroup, dim: int = -1, sizes: list[int] | None = None
) -> torch.Tensor:
    """Keep this rank's slice of `dim` forward; all-gather the gradient backward."""
    if torch.compiler.is_compiling():
        return compiled.scatter(x, dim, compiled.group_name(group), sizes)
    return _ScatterToRegion.apply(x, dim, group, sizes)


def gather_from_tensor_parallel_region(
    x: torch.Tensor, group: ProcessGroup, dim: int = -1, sizes: list[int] | None = None
) -> torch.Tensor:
    """All-gather `dim` forward (uneven shards allowed through `sizes`); keep this rank's slice backward."""
    if torch.compiler.is_compiling():
        return compiled.gather(x, dim, compiled.group_name(group), sizes)
    if not torch.is_grad_enabled():
        return all_gather(x, dim, group, sizes)
    return _GatherFromRegion.apply(x, dim, group, sizes)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup, dim: int = SEQ_DIM) -> torch.Tensor:
    """All-gather the sequence dim forward; reduce-scatter the gradient backward."""
    if torch.compiler.is_compiling():
        return compiled.sequence_gather(x, dim, compiled.group_name(group))
    return _GatherFromSequenceRegion.apply(x, dim, group)


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: ProcessGroup, dim: int = SEQ_DIM
) -> torch.Tensor:
    """Reduce-scatter over the sequence dim forward; all-gather the gradient backward."""
    if torch.compiler.is_compiling():
        return compiled.sequence_reduce_scatter(x, dim, compiled.group_name(group))
    return _ReduceScatterToSequenceRegion.apply(x, dim, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup, dim: int = SEQ_DIM) -> torch.Tensor:
    """Keep this rank's sequence slice forward; all-gather the gradient backward."""
    if torch.compiler.is_compiling():
        return compiled.scatter(x, dim, compiled.group_name(group), None)
    return _ScatterToRegion.apply(x, dim, group, None)
