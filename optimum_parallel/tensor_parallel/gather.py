"""The global tensor from its tensor-parallel shards (for exports that need whole tensors, e.g. PEFT adapters)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..mesh import ranks
from .spec import ShardLayout


def gather_full(tensor: torch.Tensor, layout: ShardLayout | None, group: ProcessGroup) -> torch.Tensor:
    """The whole tensor on every rank of `group` from each rank's shard as its spec cuts it (a collective:
    every rank calls it for the same tensors in the same order). A replicated tensor is returned as it is."""
    if layout is None or layout.dim is None:
        return tensor
    dim, tp = layout.dim, ranks.world_size(group)
    layouts = [layout.spec.local(r, tp) for r in range(tp)]
    longest = max(lay.local_shape[dim] for lay in layouts)
    local = tensor.detach().contiguous()
    if local.shape[dim] < longest:  # uneven splits: all_gather needs equal shapes
        pad = list(local.shape)
        pad[dim] = longest - local.shape[dim]
        local = torch.cat([local, local.new_zeros(pad)], dim=dim)
    pieces = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(pieces, local, group=group)
    full = local.new_empty(layout.global_shape)
    for piece, held in zip(pieces, layouts, strict=True):
        offset = 0
        for start, end in held.ranges:
            full.narrow(dim, start, end - start).copy_(piece.narrow(dim, offset, end - start))
            offset += end - start
    return full
