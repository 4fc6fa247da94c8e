"""Packed (fused) column splits, and GPT-2's `Conv1D` (weight stored [in, out]) split by columns or rows."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..tensor_parallel.conv1d import CONV1D_TYPES, ColumnParallelConv1D, RowParallelConv1D
from ..tensor_parallel.packed_linear import PackedColumnParallelLinear
from ..tensor_parallel.spec import ShardSpec, local_parameter
from .base import COLUMN, ROW, HeadSplitStyle, ParallelStyle, check_style_heads


def _is_conv1d(module: nn.Module) -> bool:
    return bool(CONV1D_TYPES) and isinstance(module, CONV1D_TYPES)


class PackedColWiseParallel(ParallelStyle):
    """Column split of a Linear or Conv1D whose output packs `parts` (q|k|v, gate|up): each part is split
    on its own, so the local output is [q_local | k_local | v_local].

    parts: the number of equal parts, or their sizes. units: heads per part (an int for every part, or
    one entry per part; None splits rows). A part with fewer heads than ranks is replicated.
    """

    swaps_module = True
    builds = COLUMN

    allowed_modules = (nn.Linear, *CONV1D_TYPES)

    def __init__(self, parts: int | Sequence[int] = 2, units: int | Sequence[int | None] | None = None) -> None:
        self.parts, self.units = parts, units

    @staticmethod
    def _out_dim(module: nn.Module) -> int:
        return 1 if _is_conv1d(module) else 0

    def part_sizes(self, module: nn.Module, name: str = "") -> list[int]:
        out = module.weight.shape[self._out_dim(module)]
        if isinstance(self.parts, int):
            if self.parts < 1 or out % self.parts:
                raise ValueError(f"{name!r}: {out} output features cannot be packed as {self.parts} equal parts")
            return [out // self.parts] * self.parts
        if sum(self.parts) != out:
            raise ValueError(f"{name!r}: packed part sizes {list(self.parts)} do not add up to {out} output features")
        return list(self.parts)

    def part_units(self, count: int) -> list[int | None]:
        if self.units is None or isinstance(self.units, int):
            return [self.units] * count
        if len(self.units) != count:
            raise ValueError(f"units {list(self.units)} must give one entry per packed part ({count} parts)")
        return list(self.units)

    def check(self, module, name, ctx):
        super().check(module, name, ctx)
        sizes = self.part_sizes(module, name)
        for size, units in zip(sizes, self.part_units(len(sizes)), strict=True):
            if units is not None and size % units:
                raise ValueError(f"{name!r}: packed part of {size} features is not a whole number of {units} heads")
            check_style_heads(units, ctx.mesh.tp_size, name)

    def param_specs(self, module):
        sizes = self.part_sizes(module)
        units = self.part_units(len(sizes))
        specs = {"weight": ShardSpec.packed(module.weight.shape, self._out_dim(module), sizes, units)}
        if module.bias is not None:
            specs["bias"] = ShardSpec.packed(module.bias.shape, 0, sizes, units)
        return specs

    def apply(self, module, name, ctx):
        rank, world = ctx.tp_rank_world
        specs = self.param_specs(module)
        params = {}
        for leaf, spec in specs.items():
            source = getattr(module, leaf)
            params[leaf] = local_parameter(source, spec.local(rank, world), source.requires_grad)
        segments = specs["weight"].replicated_segments(rank, world)
        groups = [(segment, ctx.mesh.subgroups("tp", segment.heads)) for segment in segments]
        weight, bias, group = params["weight"], params.get("bias"), ctx.mesh.tp_group
        if _is_conv1d(module):
            return ColumnParallelConv1D(weight, bias, group, groups, ctx.wiring(name))
        return PackedColumnParallelLinear(weight, bias, group, groups, ctx.wiring(name))


class ColWiseConv1D(PackedColWiseParallel):
    """Column split of a transformers `Conv1D` (weight [in, out]: split dim 1 and the bias), in whole `units`."""

    allowed_modules = CONV1D_TYPES

    def __init__(self, units: int | None = None) -> None:
        super().__init__(parts=1, units=units)


class RowWiseConv1D(HeadSplitStyle):
    """Row split of a transformers `Conv1D` (weight [in, out]: split dim 0); the output is all-reduced."""

    swaps_module = True
    builds = ROW

    allowed_modules = CONV1D_TYPES

    def param_specs(self, module):
        specs = {"weight": ShardSpec.split(module.weight.shape, 0, self.units)}
        if module.bias is not None:
            specs["bias"] = ShardSpec(module.bias.shape)
        return specs

    def apply(self, module, name, ctx):
        rank, world = ctx.tp_rank_world
        local = {
            leaf: local_parameter(getattr(module, leaf), spec.local(rank, world), getattr(module, leaf).requires_grad)
            for leaf, spec in self.param_specs(module).items()
        }
        return RowParallelConv1D(local["weight"], local.get("bias"), ctx.mesh.tp_group, ctx.wiring(name))
