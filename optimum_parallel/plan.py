"""Parallel plans: regex keys over module (or parameter) names -> styles, applied by `apply_plan`.

A plan is data: `{"model.layers.*.mlp.up_proj": ColWiseParallel(), "lm_head.weight": ColWiseParallel()}`.
Keys are Python regexes matched against full names (`re.fullmatch`), so `model.layers.*.mlp` works.
A key ending in a parameter name targets the module that owns it. Every key and every style is
checked before the first module is swapped, so a bad plan never leaves a half-parallel model.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch import nn

from .mesh import ParallelMesh
from .tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .tensor_parallel.layout import ShardLayout
from .tensor_parallel.loss import VocabParallelLMLoss


@dataclass
class PlanContext:
    """What a style needs to know while it is applied."""

    mesh: ParallelMesh
    sequence_parallel: bool = False


class ParallelStyle:
    """One way of parallelizing a module. `check` raises before anything moves; `apply` may swap the module."""

    allowed_modules: tuple[type, ...] = (nn.Module,)

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
            module, ctx.mesh.tp_group, self.units, self.gather_output, ctx.sequence_parallel, replica_group
        )


class RowWiseParallel(ParallelStyle):
    """Split a Linear's input features (torch weight dim 1), or an Embedding's rows (the vocabulary)."""

    allowed_modules = (nn.Linear, nn.Embedding)

    def __init__(self, input_is_parallel: bool = True, units: int | None = None) -> None:
        self.input_is_parallel, self.units = input_is_parallel, units

    def check(self, module, name, ctx):
        super().check(module, name, ctx)
        _check_units(self.units, ctx.mesh.tp_size, name, allow_replication=False)

    def apply(self, module, name, ctx):
        if isinstance(module, nn.Embedding):
            return VocabParallelEmbedding.from_embedding(module, ctx.mesh.tp_group, ctx.sequence_parallel)
        return RowParallelLinear.from_linear(
            module, ctx.mesh.tp_group, self.units, self.input_is_parallel, ctx.sequence_parallel
        )


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


def _as_styles(key: str, value) -> list[ParallelStyle]:
    styles = value if isinstance(value, (list, tuple)) else [value]
    for style in styles:
        if not isinstance(style, ParallelStyle):
            raise TypeError(
                f"parallelize_plan[{key!r}] holds {style!r}, which is not a parallel style; "
                f"allowed: ColWiseParallel, RowWiseParallel, PrepareLayerInput, PrepareLayerOutput, ..."
            )
    return list(styles)


def resolve_plan(model: nn.Module, plan: Mapping[str, object]) -> dict[str, list[ParallelStyle]]:
    """Map every plan key to the modules it names, in model order; unknown keys raise ValueError."""
    if not isinstance(plan, Mapping):
        raise TypeError(f"parallelize_plan must be a dict of name regex -> style, got {type(plan).__name__}")
    modules = dict(model.named_modules())
    param_owner = {name: name.rpartition(".")[0] for name, _ in model.named_parameters(remove_duplicate=False)}
    targets: dict[str, list[ParallelStyle]] = {}
    for key, value in plan.items():
        is_optional = isinstance(value, optional)
        styles = _as_styles(key, value.styles if is_optional else value)
        try:
            pattern = re.compile(key)
        except re.error as err:
            raise ValueError(f"parallelize_plan key {key!r} is not a valid regex: {err}") from None
        matched = [n for n in modules if n and pattern.fullmatch(n)]
        if not matched:
            matched = [owner for p, owner in param_owner.items() if pattern.fullmatch(p)]
        if not matched and not is_optional:
            examples = ", ".join(list(n for n in modules if n)[:6])
            raise ValueError(
                f"parallelize_plan key {key!r} matches no module or parameter of {type(model).__name__} "
                f"(names look like: {examples}, ...)"
            )
        for name in matched:
            targets.setdefault(name, []).extend(styles)
    order = {name: i for i, name in enumerate(modules)}
    return dict(sorted(targets.items(), key=lambda item: order[item[0]]))


def apply_plan(
    model: nn.Module, plan: Mapping[str, object], mesh: ParallelMesh, sequence_parallel: bool = False
) -> dict[int, nn.Parameter]:
    """Parallelize `model` in place by `plan`; return {id(original parameter): parallel parameter}."""
    ctx = PlanContext(mesh, sequence_parallel)
    targets = resolve_plan(model, plan)
    for name, styles in targets.items():
        module = model.get_submodule(name)
        for style in styles:
            style.check(module, name, ctx)

    original = dict(model.named_parameters(remove_duplicate=False))
    for name, styles in targets.items():
        module = model.get_submodule(name)
        for style in styles:
            module = style.apply(module, name, ctx)
        _replace_submodule(model, name, module)
    _retie_shared_parameters(model, original)
    _install_vocab_parallel_loss(model)

    current = dict(model.named_parameters(remove_duplicate=False))
    return {id(param): current[name] for name, param in original.items()}


def _replace_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    if getattr(parent, child) is not module:
        setattr(parent, child, module)


def _retie_shared_parameters(model: nn.Module, original: dict[str, nn.Parameter]) -> None:
    """Parameters shared before (tied embeddings) stay shared, if every user was split the same way."""
    groups: dict[int, list[str]] = {}
    for name, param in original.items():
        groups.setdefault(id(param), []).append(name)
    for names in (g for g in groups.values() if len(g) > 1):
        owners = [model.get_submodule(n.rpartition(".")[0]) for n in names]
        leaves = [n.rpartition(".")[2] for n in names]
        layouts = [getattr(getattr(m, leaf), "shard_layout", None) for m, leaf in zip(owners, leaves, strict=True)]
        if any(layout != layouts[0] for layout in layouts):
            raise ValueError(
                f"tied parameters {names} are split differently ({layouts}); give every module that shares "
                "them the same style (e.g. vocab-parallel embedding and column-parallel lm_head)"
            )
        shared = getattr(owners[0], leaves[0])
        for module, leaf in zip(owners[1:], leaves[1:], strict=True):
            setattr(module, leaf, shared)


def _install_vocab_parallel_loss(model: nn.Module) -> None:
    """A column-parallel LM head without gathered output needs the vocab-parallel loss."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    if not isinstance(head, ColumnParallelLinear) or head.gather_output:
        return
    loss_type = getattr(model, "loss_type", None)
    shifts = {"ForCausalLM": True, "ForConditionalGeneration": True, "ForMaskedLM": False}
    if loss_type not in shifts:
        raise ValueError(
            f"a vocab-parallel LM head needs a vocab-parallel loss, available for loss types {sorted(shifts)}, "
            f"not {loss_type!r}; use ColWiseParallel(gather_output=True) for this head instead"
        )
    vocab_start = head.weight.shard_layout.ranges[0][0]
    model.loss_function = VocabParallelLMLoss(head.group, vocab_start, shift=shifts[loss_type])


def parallel_layouts(model: nn.Module) -> dict[str, ShardLayout]:
    """{parameter name: ShardLayout} for every split parameter of `model`."""
    return {name: p.shard_layout for name, p in model.named_parameters() if hasattr(p, "shard_layout")}
