"""The plain collectives of the tensor-parallel regions: torch.distributed calls, or the same call on the group's
`SharedMemoryGroup` for CPU tensors of ranks that share a host (see `shared_memory`). The eager region functions
(`autograd_collectives.py`) and the compiled region ops (`compiled.py`) both run these."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from ..mesh import device as devices
from ..mesh import ranks
from .shared_memory import shared_memory_group


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


def all_gather(x: torch.Tensor, dim: int, group: ProcessGroup, sizes: list[int] | None = None) -> torch.Tensor:
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


def split(x: torch.Tensor, dim: int, group: ProcessGroup, sizes: list[int] | None = None) -> torch.Tensor:
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


def reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    out, work = start_reduce_scatter(x, dim, group)
    if work is not None:
        work.wait()
    return out
