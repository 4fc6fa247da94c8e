"""Parallel styles: how one module is parallelized (the values of a plan).

Each style checks that it fits its module before anything moves (`check`) and then swaps or
hooks the module (`apply`). Styles know the engine's layers, never a model family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from .mesh import ParallelMesh
from .tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


@dataclass
class PlanContext:
    """What a style needs to know while it is applied."""

    mesh: ParallelMesh


class ParallelStyle:
    """One way of parallelizing a module. `check` raises before anything moves; `apply` may swap the module."""

    allowed_modules: tuple[type, ...] = (nn.Module,)
    swaps_module = False  # True for styles that replace the module (applied before hooks and markers)

    def check(self, module: nn.Module, name: str, ctx: PlanContext) -> None:
        if not isinstance(module, self.allowed_modules):
            allowed = ", ".join(t.__name__ for t in self.allowed_modules)
            raise ValueError(
                f"{type(self).__name__} does not fit module {name!r} of type {type(module).__name__}; "
                f"it applies to: {allowed}"
            )

    def apply(self, module: nn.Module, name: str, ctx: PlanContext) -> nn.Module:
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class ColWiseParallel(ParallelStyle):
    """Split a Linear's output features (torch weight dim 0) over tp.

    units: split in whole blocks (attention heads); fewer heads than ranks replicates each head
    over tp/heads ranks and sums their gradients. gather_output: all-gather the output features.
    """

    allowed_modules = (nn.Linear,)
    swaps_module = True

    def __init__(self, gather_output: bool = False, units: int | None = None) -> None:
        self.gather_output, self.units = gather_output, units

    def check(self, module, name, ctx):
        super().check(module, name, ctx)
        _check_units(self.units, ctx.mesh.tp_size, name)

    def apply(self, module, name, ctx):
        tp = ctx.mesh.tp_size
        replica_group = None
        if self.units is not None and self.units < tp:
            replica_group = ctx.mesh.subgroups("tp", self.units)
        return ColumnParallelLinear.from_linear(
            module, ctx.mesh.tp_group, self.units, self.gather_output, replica_group=replica_group
        )


class RowWiseParallel(ParallelStyle):
    """Split a Linear's input features (torch weight dim 1), or an Embedding's rows (the vocabulary)."""

    allowed_modules = (nn.Linear, nn.Embedding)
    swaps_module = True

    def __init__(self, input_is_parallel: bool = True, units: int | None = None) -> None:
        self.input_is_parallel, self.units = input_is_parallel, units

    def check(self, module, name, ctx):
        super().check(module, name, ctx)
        _check_units(self.units, ctx.mesh.tp_size, name, allow_replication=False)

    def apply(self, module, name, ctx):
        if isinstance(module, nn.Embedding):
            return VocabParallelEmbedding.from_embedding(module, ctx.mesh.tp_group)
        return RowParallelLinear.from_linear(module, ctx.mesh.tp_group, self.units, self.input_is_parallel)


class PrepareLayerInput(ParallelStyle):
    """Run `fn(module, args, kwargs)` before the module (torch's forward pre-hook with kwargs contract:
    return None or a new `(args, kwargs)`)."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def apply(self, module, name, ctx):
        module.register_forward_pre_hook(self.fn, with_kwargs=True)
        return module


class PrepareLayerOutput(ParallelStyle):
    """Run `fn(module, args, output)` after the module (torch's forward hook: return None or a new output)."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def apply(self, module, name, ctx):
        module.register_forward_hook(self.fn)
        return module


@dataclass(frozen=True)
class optional:  # noqa: N801 - reads as a marker in plans: {"lm_head": optional(ColWiseParallel())}
    """Mark a plan entry that may match nothing (model-family plans covering several variants)."""

    styles: ParallelStyle | list[ParallelStyle]


def _check_units(units: int | None, tp: int, name: str, allow_replication: bool = True) -> None:
    if units is None:
        return
    if units >= tp and units % tp == 0:
        return
    if allow_replication and units < tp and tp % units == 0:
        return
    raise ValueError(
        f"{name!r}: {units} heads cannot be split over tensor-parallel size {tp}; "
        f"tp must divide {units}" + (" or be a multiple of it" if allow_replication else "")
    )
