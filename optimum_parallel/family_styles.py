"""Styles that model families need beyond plain column/row splits: packed (fused) projections, GPT-2's
Conv1D, parameters replicated over split work, head-split embeddings, tensor-parallel experts and
MLM heads with a tied bias.

Like `styles.py`, each style checks before anything moves and then swaps or hooks one module. Every
style that splits parameters also answers `param_layouts(module, rank, world)` without a process
group, so a plan can be resolved for any tp size on one process (see `plan_report`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from .sequence_parallel import sum_parameter_gradients
from .styles import ParallelStyle, PlanContext
from .tensor_parallel.comm import shard_range
from .tensor_parallel.conv1d import CONV1D_TYPES, ColumnParallelConv1D, RowParallelConv1D
from .tensor_parallel.experts import expert_layouts, shard_experts
from .tensor_parallel.fused import PackedColumnParallelLinear, packed_layout
from .tensor_parallel.layers import ColumnParallelLinear
from .tensor_parallel.layout import ShardLayout, local_parameter, replicated, split_units

__all__ = [
    "ColWiseConv1D",
    "LocalColWiseEmbedding",
    "PackedColWiseParallel",
    "ReplicatedWithGradAllReduce",
    "RowWiseConv1D",
    "TensorParallelExperts",
    "TiedBiasColWiseParallel",
]


def _check_heads(units: int | None, tp: int, name: str, what: str, allow_replication: bool = True) -> None:
    if units is None or (units >= tp and units % tp == 0) or (allow_replication and units < tp and tp % units == 0):
        return
    allowed = f"tp must divide {units}" + (" or be a multiple of it" if allow_replication else "")
    raise ValueError(f"{name!r}: {what}={units} cannot be split over tensor-parallel size {tp}; {allowed}")


def _is_conv1d(module: nn.Module) -> bool:
    return bool(CONV1D_TYPES) and isinstance(module, CONV1D_TYPES)


def _tp_rank_world(ctx: PlanContext) -> tuple[int, int]:
    group = ctx.mesh.tp_group
    return dist.get_rank(group), dist.get_world_size(group)


class PackedColWiseParallel(ParallelStyle):
    """Column split of a Linear or Conv1D whose output packs `parts` (q|k|v, gate|up): each part is split
    on its own, so the local output is [q_local | k_local | v_local].

    parts: the number of equal parts, or their sizes. units: heads per part (an int for every part, or
    one entry per part; None splits rows). A part with fewer heads than ranks is replicated.
    """

    swaps_module = True

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
            _check_heads(units, ctx.mesh.tp_size, name, "heads")

    def _layouts(self, module: nn.Module, rank: int, world: int):
        sizes = self.part_sizes(module)
        units = self.part_units(len(sizes))
        weight, segments = packed_layout(tuple(module.weight.shape), self._out_dim(module), sizes, units, rank, world)
        layouts = {"weight": weight}
        if module.bias is not None:
            layouts["bias"] = packed_layout(tuple(module.bias.shape), 0, sizes, units, rank, world)[0]
        return layouts, segments

    def param_layouts(self, module: nn.Module, rank: int, world: int) -> dict[str, ShardLayout]:
        return self._layouts(module, rank, world)[0]

    def apply(self, module, name, ctx):
        rank, world = _tp_rank_world(ctx)
        layouts, segments = self._layouts(module, rank, world)
        params = {}
        for param_name, layout in layouts.items():
            source = getattr(module, param_name)
            params[param_name] = local_parameter(source, layout, source.requires_grad)
        groups = [(segment, ctx.mesh.subgroups("tp", segment.units)) for segment in segments]
        weight, bias, group = params["weight"], params.get("bias"), ctx.mesh.tp_group
        if _is_conv1d(module):
            return ColumnParallelConv1D(weight, bias, group, groups)
        return PackedColumnParallelLinear(weight, bias, group, groups)


class ColWiseConv1D(PackedColWiseParallel):
    """Column split of a transformers `Conv1D` (weight [in, out]: split dim 1 and the bias), in whole `units`."""

    allowed_modules = CONV1D_TYPES

    def __init__(self, units: int | None = None) -> None:
        super().__init__(parts=1, units=units)


class RowWiseConv1D(ParallelStyle):
    """Row split of a transformers `Conv1D` (weight [in, out]: split dim 0); the output is all-reduced."""

    swaps_module = True

    allowed_modules = CONV1D_TYPES

    def __init__(self, units: int | None = None) -> None:
        self.units = units

    def check(self, module, name, ctx):
        super().check(module, name, ctx)
        _check_heads(self.units, ctx.mesh.tp_size, name, "heads", allow_replication=False)

    def param_layouts(self, module: nn.Module, rank: int, world: int) -> dict[str, ShardLayout]:
        layouts = {"weight": split_units(tuple(module.weight.shape), 0, rank, world, self.units)}
        if module.bias is not None:
            layouts["bias"] = replicated(module.bias.shape)
        return layouts

    def apply(self, module, name, ctx):
        rank, world = _tp_rank_world(ctx)
        layouts = self.param_layouts(module, rank, world)
        weight = local_parameter(module.weight, layouts["weight"], module.weight.requires_grad)
        bias = None
        if module.bias is not None:
            bias = local_parameter(module.bias, layouts["bias"], module.bias.requires_grad)
        return RowParallelConv1D(weight, bias, ctx.mesh.tp_group)


class ReplicatedWithGradAllReduce(ParallelStyle):
    """Keep the module's parameters whole on every rank, but sum their gradients over tp.

    For parameters applied to split work (Qwen3's per-head q_norm/k_norm see only this rank's heads),
    each rank's gradient is a partial sum. The sum happens in the forward path (FSDP2/DDP-safe); it
    covers the module's own parameters.
    """

    def param_layouts(self, module: nn.Module, rank: int, world: int) -> dict[str, ShardLayout]:
        return {}

    def apply(self, module, name, ctx):
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            sum_parameter_gradients(module, ctx.mesh.tp_group)
        return module


class LocalColWiseEmbedding(ParallelStyle):
    """Split an Embedding's columns (dim 1) in whole `units` and keep its output split: no communication.

    For per-head tables such as T5's relative attention bias (buckets x heads): each rank looks up
    the bias of its own heads only.
    """

    swaps_module = True

    allowed_modules = (nn.Embedding,)

    def __init__(self, units: int | None = None) -> None:
        self.units = units

    def check(self, module, name, ctx):
        super().check(module, name, ctx)
        _check_heads(self.units, ctx.mesh.tp_size, name, "heads", allow_replication=False)

    def param_layouts(self, module: nn.Module, rank: int, world: int) -> dict[str, ShardLayout]:
        return {"weight": split_units(tuple(module.weight.shape), 1, rank, world, self.units)}

    def apply(self, module, name, ctx):
        rank, world = _tp_rank_world(ctx)
        layout = self.param_layouts(module, rank, world)["weight"]
        module.weight = local_parameter(module.weight, layout, module.weight.requires_grad)
        module.embedding_dim = module.weight.shape[1]
        return module


class TensorParallelExperts(ParallelStyle):
    """Split every expert's intermediate dim over tp (3D expert tensors, transformers 5 layout).

    packed: tensors packing gate|up (split each half on its own); row: tensors whose input is the
    intermediate dim. The experts module becomes one tp region; the router stays replicated.
    """

    swaps_module = True

    def __init__(self, packed: Sequence[str] = ("gate_up_proj",), row: Sequence[str] = ("down_proj",)) -> None:
        self.packed, self.row = tuple(packed), tuple(row)

    def check(self, module, name, ctx):
        super().check(module, name, ctx)
        for param_name in self.packed + self.row:
            param = getattr(module, param_name, None)
            if not isinstance(param, nn.Parameter) or param.dim() != 3:
                raise ValueError(
                    f"TensorParallelExperts on {name!r}: {param_name!r} is not a 3D expert tensor "
                    f"(packed={self.packed}, row={self.row})"
                )
        if getattr(module, "has_bias", False):
            raise ValueError(f"TensorParallelExperts on {name!r}: experts with biases are not supported yet")
        for param_name in self.packed:
            param = getattr(module, param_name)
            dim = param.dim() - 1 if getattr(module, "is_transposed", False) else param.dim() - 2
            if param.shape[dim] % 2:
                raise ValueError(f"{name}.{param_name}: packed gate|up dim of size {param.shape[dim]} is odd")
            pairs, tp = param.shape[dim] // 2, ctx.mesh.tp_size
            if not getattr(module, "is_concatenated", True) and pairs % tp:
                raise ValueError(
                    f"{name}.{param_name}: {pairs} interleaved gate/up pairs cannot be split over tensor-parallel "
                    f"size {tp}; tp must divide {pairs}"
                )

    def param_layouts(self, module: nn.Module, rank: int, world: int) -> dict[str, ShardLayout]:
        return expert_layouts(module, self.packed, self.row, rank, world)

    def apply(self, module, name, ctx):
        rank, world = _tp_rank_world(ctx)
        layouts = self.param_layouts(module, rank, world)
        shard_experts(module, layouts, ctx.mesh.tp_group)
        if self.row and hasattr(module, "intermediate_dim"):
            row = layouts[self.row[0]]
            module.intermediate_dim = row.local_shape[row.dim]
        return module


class TiedBiasColWiseParallel(ParallelStyle):
    """Column-split the Linear `child` of an MLM head whose output bias is tied to the head's own `bias`
    (BERT's `cls.predictions`, RoBERTa's `lm_head`), keeping the tie; the logits are gathered by default
    because those models compute their loss on full logits."""

    swaps_module = True

    def __init__(self, child: str = "decoder", bias: str = "bias", gather_output: bool = True) -> None:
        self.child, self.bias, self.gather_output = child, bias, gather_output

    def check(self, module, name, ctx):
        super().check(module, name, ctx)
        if not isinstance(getattr(module, self.child, None), nn.Linear):
            raise ValueError(f"TiedBiasColWiseParallel on {name!r}: no Linear child named {self.child!r}")

    def param_layouts(self, module: nn.Module, rank: int, world: int) -> dict[str, ShardLayout]:
        linear = getattr(module, self.child)
        vocab = linear.weight.shape[0]
        rows = ShardLayout(tuple(linear.weight.shape), 0, (shard_range(vocab, rank, world),))
        layouts = {f"{self.child}.weight": rows}
        if linear.bias is not None:
            layouts[f"{self.child}.bias"] = ShardLayout((vocab,), 0, rows.ranges)
            if getattr(module, self.bias, None) is linear.bias:
                layouts[self.bias] = layouts[f"{self.child}.bias"]
        return layouts

    def apply(self, module, name, ctx):
        linear = getattr(module, self.child)
        tied = linear.bias is not None and getattr(module, self.bias, None) is linear.bias
        new = ColumnParallelLinear.from_linear(linear, ctx.mesh.tp_group, None, self.gather_output)
        setattr(module, self.child, new)
        if tied:
            setattr(module, self.bias, new.bias)
        return module
