"""ShardLayout: where a rank's local tensor sits inside the global one (parameters carry their own)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .comm import shard_range


@dataclass(frozen=True)
class ShardLayout:
    """The local tensor is the concatenation, along `dim`, of `ranges` of the global tensor.

    `dim=None` means replicated. `replicas` > 1 means that many tp ranks hold this same shard
    (e.g. a kv head replicated because tp > num_key_value_heads); their gradients are summed.
    Several ranges describe fused layouts (one range per fused part).
    """

    global_shape: tuple[int, ...]
    dim: int | None = None
    ranges: tuple[tuple[int, int], ...] = ()
    replicas: int = 1

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.global_shape
        shape = list(self.global_shape)
        shape[self.dim] = sum(end - start for start, end in self.ranges)
        return tuple(shape)

    def slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor cut out of the global `full` (a tensor or a safetensors slice)."""
        if self.dim is None:
            return full
        parts = [full.narrow(self.dim, start, end - start) for start, end in self.ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)

    def to_dict(self) -> dict:
        return {
            "global_shape": list(self.global_shape),
            "dim": self.dim,
            "ranges": [list(r) for r in self.ranges],
            "replicas": self.replicas,
        }


def replicated(shape: torch.Size | tuple[int, ...]) -> ShardLayout:
    return ShardLayout(tuple(shape))


def split_units(
    global_shape: tuple[int, ...], dim: int, rank: int, world: int, units: int | None = None
) -> ShardLayout:
    """Split `dim` over `world` ranks in whole `units` (attention heads; None = single rows, uneven allowed).

    units >= world: each rank takes units/world consecutive units (must divide evenly).
    units <  world: world/units consecutive ranks share one unit (replicated; must divide evenly).
    """
    size = global_shape[dim]
    if units is None:
        return ShardLayout(tuple(global_shape), dim, (shard_range(size, rank, world),))
    if size % units:
        raise ValueError(f"dimension {dim} of size {size} is not a whole number of {units} units")
    unit = size // units
    if units >= world:
        if units % world:
            raise ValueError(f"{units} units (heads) cannot be split evenly over {world} tensor-parallel ranks")
        per_rank = units // world
        start = rank * per_rank * unit
        return ShardLayout(tuple(global_shape), dim, ((start, start + per_rank * unit),))
    if world % units:
        raise ValueError(f"{world} tensor-parallel ranks cannot share {units} units (heads) evenly")
    replicas = world // units
    start = (rank // replicas) * unit
    return ShardLayout(tuple(global_shape), dim, ((start, start + unit),), replicas=replicas)


def local_parameter(source: torch.Tensor, layout: ShardLayout, requires_grad: bool) -> nn.Parameter:
    """This rank's slice of `source` as a new Parameter carrying its `shard_layout` (meta stays meta)."""
    local = layout.slice(source.detach())
    if local.device.type != "meta":
        local = local.clone()
    param = nn.Parameter(local.contiguous(), requires_grad=requires_grad)
    param.shard_layout = layout
    return param
