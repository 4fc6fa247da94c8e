"""Autograd-aware communication for tensor (and sequence) parallel regions.

Megatron's conjugate pairs, each an autograd.Function over one process group:
copy (identity / all-reduce), reduce (all-reduce / identity), scatter (split / all-gather),
gather (all-gather / split), and the sequence-dim pair all-gather / reduce-scatter.
Every collective is a torch.distributed call, or the same call on the group's `SharedMemoryGroup` for CPU
tensors of ranks that share a host (see `shared_memory`); tests count both. Ranks and sizes come from
`mesh.ranks`; on XLA devices a rank's slice is taken with indices that reach the device as data, so every rank
runs the same compiled graph. Traced by torch.compile, each region op is the custom op of `compiled.py` instead
(one graph node, the same transports).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from ..mesh import device as devices
from ..mesh import ranks
from . import compiled
from .shared_memory import shared_memory_group

SEQ_DIM = 1  # activations are [batch, seq, hidden]: sequence parallelism splits dim 1


def all_reduce(x: torch.Tensor, group: ProcessGroup, op=ReduceOp.SUM) -> torch.Tensor:
    """`x` reduced over `group` (in place once contiguous)."""
    if ranks.world_size(group) > 1:
        x = x.contiguous()
        shared = shared_memory_group(group, x)
        if shared is not None and shared.reduces(op):
            shared.all_reduce(x, op)
        else:
            dist.all_reduce(x, op=op, group=group)
    return x


def _all_gather(x: torch.Tensor, dim: int, group: ProcessGroup, sizes: list[int] | None = None) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`; `sizes` allows uneven shards (padded on the wire)."""
    world = ranks.world_size(group)
    if world == 1:
        return x
    dim = dim % x.dim()
    longest = max(sizes) if sizes else x.shape[dim]
    if x.shape[dim] < longest:
        pad = list(x.shape)
        pad[dim] = longest - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad)], dim=dim)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    shared = shared_memory_group(group, x)
    if shared is not None and shared.fits(x):
        shared.all_gather(parts, x)
    else:
        dist.all_gather(parts, x, group=group)
    if sizes:
        parts = [p.narrow(dim, 0, s) for p, s in zip(parts, sizes, strict=True)]
    return torch.cat(parts, dim=dim)


def _split(x: torch.Tensor, dim: int, group: ProcessGroup, sizes: list[int] | None = None) -> torch.Tensor:
    world = ranks.world_size(group)
    if world == 1:
        return x
    rank = ranks.rank(group)
    if not sizes:  # an even split, the first ranks one larger (as `tensor_parallel.spec.shard_sizes`)
        length = x.shape[dim]
        sizes = [length // world + (r < length % world) for r in range(world)]
    start = sum(sizes[:rank])
    if devices.is_graph_device(x):  # the offset as data: the same graph on every rank
        return x.index_select(dim, ranks.device_indices(start, sizes[rank], x.device))
    return x.narrow(dim, start, sizes[rank]).contiguous()


def start_all_reduce(x: torch.Tensor, group: ProcessGroup, op=ReduceOp.SUM) -> tuple[torch.Tensor, dist.Work | None]:
    """Start an all-reduce of `x` (in place once contiguous): the tensor, and the handle to wait on (None if
    there is nothing to do)."""
    if ranks.world_size(group) == 1:
        return x, None
    x = x.contiguous()
    shared = shared_memory_group(group, x)
    if shared is not None and shared.reduces(op):
        return x, shared.all_reduce(x, op, async_op=True)
    return x, dist.all_reduce(x, op=op, group=group, async_op=True)


def start_reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup) -> tuple[torch.Tensor, dist.Work | None]:
    """Start a reduce-scatter of `x` along `dim`: this rank's chunk of the sum (filled once the handle is
    waited on), and the handle (None if there is nothing to do)."""
    world = ranks.world_size(group)
    if world == 1:
        return x, None
    chunks = [c.contiguous() for c in x.chunk(world, dim=dim)]
    out = torch.empty_like(chunks[ranks.rank(group)])
    shared = shared_memory_group(group, x)
    if shared is not None and shared.fits(x):
        return out, shared.reduce_scatter(out, chunks, async_op=True)
    return out, dist.reduce_scatter(out, chunks, group=group, async_op=True)


def _reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    out, work = start_reduce_scatter(x, dim, group)
    if work is not None:
        work.wait()
    return out


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
        return _split(x, dim, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group, ctx.sizes), None, None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, sizes):
        ctx.dim, ctx.group, ctx.sizes = dim, group, sizes
        return _all_gather(x, dim, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group, ctx.sizes), None, None, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


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
        return _all_gather(x, dim, group, sizes)
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
