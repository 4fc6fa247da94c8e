"""Parallel plans: regex keys over module (or parameter) names -> styles, applied by `apply_plan`.

A plan is data: `{"model.layers.*.mlp.up_proj": ColWiseParallel(), "lm_head.weight": ColWiseParallel()}`.
Keys are Python regexes matched against full names (`re.fullmatch`), so `model.layers.*.mlp` works.
A key ending in a parameter name targets the module that owns it. Every key and every style is
checked before the first module is swapped, so a bad plan never leaves a half-parallel model.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from ..comm.tp_entry import SequenceRegion
from ..mesh import ParallelMesh
from ..styles import ParallelStyle, PlanContext, optional
from ..tensor_parallel.spec import ShardLayout
from .caller_outputs import install_full_logits, install_generation_sync, install_sequence_region
from .fixups import install_vocab_parallel_loss, localize_attention_heads, retie_shared_parameters
from .wiring import plan_context
from .wrappers import handler_for, style_target, wrapper_handlers


def _as_styles(key: str, value) -> list[ParallelStyle]:
    styles = value if isinstance(value, (list, tuple)) else [value]
    for style in styles:
        if not isinstance(style, ParallelStyle):
            raise TypeError(
                f"parallelize_plan[{key!r}] holds {style!r}, which is not a parallel style; "
                f"allowed: ColWiseParallel, RowWiseParallel, PrepareLayerInput, PrepareLayerOutput, ..."
            )
    return list(styles)


def resolve_plan(
    model: nn.Module, plan: Mapping[str, object], modules: Mapping[str, nn.Module] | None = None
) -> dict[str, list[ParallelStyle]]:
    """Map every plan key to the modules it names, in model order; unknown keys raise ValueError. `modules`:
    `dict(model.named_modules())` where the caller has it already."""
    if not isinstance(plan, Mapping):
        raise TypeError(f"parallelize_plan must be a dict of name regex -> style, got {type(plan).__name__}")
    modules = dict(model.named_modules()) if modules is None else modules
    param_owner: dict[str, str] | None = None  # parameter name -> its module's, read when a key names no module
    module_styles: dict[str, list[ParallelStyle]] = {}
    for key, value in plan.items():
        is_optional = isinstance(value, optional)
        styles = _as_styles(key, value.styles if is_optional else value)
        try:
            pattern = re.compile(key)
        except re.error as err:
            raise ValueError(f"parallelize_plan key {key!r} is not a valid regex: {err}") from None
        matched = [n for n in modules if n and pattern.fullmatch(n)]
        if not matched:
            if param_owner is None:
                named = model.named_parameters(remove_duplicate=False)
                param_owner = {name: name.rpartition(".")[0] for name, _ in named}
            matched = [owner for p, owner in param_owner.items() if pattern.fullmatch(p)]
        if not matched and not is_optional:
            examples = ", ".join(list(n for n in modules if n)[:6])
            raise ValueError(
                f"parallelize_plan key {key!r} matches no module or parameter of {type(model).__name__} "
                f"(names look like: {examples}, ...)"
            )
        for name in matched:
            module_styles.setdefault(name, []).extend(styles)
    order = {name: i for i, name in enumerate(modules)}
    return dict(sorted(module_styles.items(), key=lambda item: order[item[0]]))


def check_plan(model: nn.Module, plan: Mapping[str, object], mesh: ParallelMesh) -> dict[str, list[ParallelStyle]]:
    """Resolve every key and check every style against its module, and every wrapper (LoRA) around one against
    what the styles make of its layer; raise before anything is modified."""
    ctx = PlanContext(mesh)  # checks read the mesh only
    modules = dict(model.named_modules())  # get_submodule per target was half of a 70B model's check (the planner)
    module_styles = resolve_plan(model, plan, modules)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    for name, styles in module_styles.items():
        wrapper = modules[name]
        module = style_target(wrapper)
        for style in styles:
            style.check(module, name, ctx)
        handler = handler_for(wrapper) if module is not wrapper else None
        if handler is not None and handler.check is not None:
            handler.check(wrapper, styles, name, wrapper is head)
    return module_styles


@dataclass
class AppliedPlan:
    """What applying a plan made: {id(original parameter): parallel parameter}, and the model's sequence-parallel
    region (None without sequence-parallel styles), which a pipeline's stages enter again."""

    param_map: dict[int, nn.Parameter]
    sequence: SequenceRegion | None
    layers: dict[str, str]  # module name -> COLUMN or ROW: the tensor-parallel layers it built


def apply_plan(model: nn.Module, plan: Mapping[str, object], mesh: ParallelMesh) -> dict[int, nn.Parameter]:
    """Parallelize `model` in place by `plan`; return {id(original parameter): parallel parameter}."""
    return apply_checked_plan(model, check_plan(model, plan, mesh), mesh).param_map


def apply_checked_plan(
    model: nn.Module, module_styles: dict[str, list[ParallelStyle]], mesh: ParallelMesh, *, overlap: bool = True
) -> AppliedPlan:
    """Parallelize `model` in place by `module_styles` (module name -> styles: what `check_plan` returned for it,
    unchanged since).

    Every layer's mode is decided first, from the whole plan (`wiring.py`); then module-swapping styles
    (ColWise/RowWise) run, then the hooks and markers, so a marker on a module sees its children already swapped
    whatever the order of the plan's keys. `overlap`: weight gradients may be computed during the entry's backward
    collective (off under pipeline schedules that defer them themselves).
    """
    ctx = plan_context(model, module_styles, mesh, overlap)

    original = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())  # kept in step with the swaps (get_submodule was a quarter of the time)
    for swapping in (True, False):
        for name, styles in module_styles.items():
            wrapper = modules[name]
            module = style_target(wrapper)
            for style in styles:
                if style.swaps_module == swapping:
                    module = style.apply(module, name, ctx)
            if module is wrapper or wrapper is style_target(wrapper):
                _replace_submodule(model, modules, name, module)
            elif wrapper.base_layer is not module:  # a wrapper (LoRA) around the swapped layer: its own
                module.train(wrapper.base_layer.training)
                wrapper.base_layer = module  # parameters are split to follow the layer's split
                handler_for(wrapper).parallelize(wrapper, ctx)
    for handler in wrapper_handlers():
        if handler.after_apply is not None:
            handler.after_apply(model, ctx)
    retie_shared_parameters(model, original)
    install_vocab_parallel_loss(model)
    install_full_logits(model)  # callers see full-vocabulary logits (see plan/caller_outputs.py)
    if ctx.sequence is not None:
        install_sequence_region(model, ctx.sequence)
    install_generation_sync(model)
    localize_attention_heads(model)

    current = dict(model.named_parameters(remove_duplicate=False))
    return AppliedPlan({id(param): current[name] for name, param in original.items()}, ctx.sequence, ctx.kinds)


def _replace_submodule(model: nn.Module, modules: dict[str, nn.Module], name: str, module: nn.Module) -> None:
    """Put `module` at `name`, and keep `modules` (model.named_modules()) up to date."""
    replaced = modules[name]
    if replaced is module:
        return
    module.train(replaced.training)  # a layer built in place of an eval-mode module is in eval mode too
    parent_name, _, child = name.rpartition(".")
    setattr(modules[parent_name], child, module)
    modules[name] = module
    if next(replaced.children(), None) is not None:  # a swapped container: its descendants' names changed
        modules.clear()
        modules.update(model.named_modules())


def parallel_layouts(model: nn.Module) -> dict[str, ShardLayout]:
    """{parameter name: ShardLayout} for every split parameter of `model`."""
    return {name: p.shard_layout for name, p in model.named_parameters() if hasattr(p, "shard_layout")}
