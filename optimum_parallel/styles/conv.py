"""Depthwise Conv1d split by channels: the short convolutions of state-space and linear-attention mixers."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..tensor_parallel.depthwise import localize_depthwise_conv
from ..tensor_parallel.spec import ShardSpec, shard_parameter
from .base import ParallelStyle, check_style_heads


class DepthwiseConvParallel(ParallelStyle):
    """Split a depthwise `nn.Conv1d` (weight [C, 1, K], groups == C) by channels, with its bias.

    parts: the sizes of the packed channel parts (x | B | C: each convolved channel block is cut on its own, like the
    projection that feeds it); units: heads (or groups) per part, None splits rows. A part with fewer units than ranks
    is replicated over tp / units ranks, its gradients summed over them. `groups` becomes the local channel count.
    """

    allowed_modules = (nn.Conv1d,)

    def __init__(self, parts: Sequence[int] | None = None, units: Sequence[int | None] | None = None) -> None:
        self.parts = None if parts is None else tuple(parts)
        self.units = None if units is None else tuple(units)

    def _layout(self, module: nn.Conv1d) -> tuple[list[int], list[int | None]]:
        sizes = list(self.parts) if self.parts is not None else [module.out_channels]
        units = list(self.units) if self.units is not None else [None] * len(sizes)
        return sizes, units

    def check(self, module, name, ctx):
        super().check(module, name, ctx)
        if module.groups != module.in_channels or module.in_channels != module.out_channels:
            raise ValueError(
                f"DepthwiseConvParallel on {name!r}: a depthwise conv (groups == in == out channels) is required, got "
                f"groups={module.groups}, in_channels={module.in_channels}, out_channels={module.out_channels}"
            )
        sizes, units = self._layout(module)
        if sum(sizes) != module.out_channels or len(units) != len(sizes):
            raise ValueError(f"{name!r}: channel parts {sizes} (units {units}) do not add up to {module.out_channels}")
        for size, count in zip(sizes, units, strict=True):
            if count is not None and size % count:
                raise ValueError(f"{name!r}: channel part of {size} is not a whole number of {count} heads")
            check_style_heads(count, ctx.mesh.tp_size, name)

    def param_specs(self, module):
        sizes, units = self._layout(module)
        specs = {"weight": ShardSpec.packed(module.weight.shape, 0, sizes, units)}
        if module.bias is not None:
            specs["bias"] = ShardSpec.packed(module.bias.shape, 0, sizes, units)
        return specs

    def apply(self, module, name, ctx):
        rank, world = ctx.tp_rank_world
        specs = self.param_specs(module)
        for leaf, spec in specs.items():
            shard_parameter(module, leaf, spec, rank, world)
        segments = specs["weight"].replicated_segments(rank, world)
        groups = [(segment, ctx.mesh.subgroups("tp", segment.heads)) for segment in segments]
        return localize_depthwise_conv(module, module.weight.shape[0], groups)
