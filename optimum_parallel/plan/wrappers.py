"""Layers that wrap the module a plan names (PEFT's LoRA layers wrap `q_proj` around a `base_layer`).

A style applies to the wrapped layer; the wrapper's handler, registered by its integration, then splits the
wrapper's own parameters to match (`handler.parallelize(wrapper, ctx)`). The engine knows no wrapper library:
integrations register handlers here, found through the entry-point group `optimum_parallel.wrappers` on first use
(as families are), so no import order matters and nothing is loaded before a plan runs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ..plugins import plugin_entry_points


@dataclass(frozen=True)
class WrapperHandler:
    """`matches(module)`: is this a wrapper the handler knows; `parallelize(wrapper, ctx)`: split its own
    parameters once its `base_layer` has been swapped; `after_apply(model, ctx)`: anything to do once the
    whole plan has been applied (e.g. make later-created wrappers work); `check(wrapper, styles, name, lm_head)`:
    raise, before the plan changes anything, if the wrapper cannot follow what `styles` will make of its layer
    (`lm_head`: the wrapper is the model's output embedding)."""

    name: str
    matches: Callable[[nn.Module], bool]
    parallelize: Callable[[nn.Module, object], None]
    after_apply: Callable[[nn.Module, object], None] | None = None
    check: Callable[[nn.Module, list, str, bool], None] | None = None


ENTRY_POINT_GROUP = "optimum_parallel.wrappers"  # each entry: a function that registers its handlers
_HANDLERS: dict[str, WrapperHandler] = {}
_discovered = False


def register_wrapper_handler(handler: WrapperHandler) -> None:
    _HANDLERS[handler.name] = handler


def wrapper_handlers() -> list[WrapperHandler]:
    """Every registered handler; the entry points' registrations run on the first call."""
    global _discovered
    if not _discovered:
        _discovered = True
        for entry in plugin_entry_points(ENTRY_POINT_GROUP):
            try:
                entry.load()()
            except Exception as err:  # a broken third-party plugin must not break the others
                warnings.warn(
                    f"could not register wrapper handlers {entry.name!r} ({entry.value}): {err}", stacklevel=2
                )
    return list(_HANDLERS.values())


def handler_for(module: nn.Module) -> WrapperHandler | None:
    return next((h for h in wrapper_handlers() if h.matches(module)), None)


def style_target(module: nn.Module) -> nn.Module:
    """The module a style acts on: a known wrapper's `base_layer`, else the module itself."""
    base = getattr(module, "base_layer", None)
    return base if isinstance(base, nn.Module) and handler_for(module) is not None else module


def unwrap(module: nn.Module) -> nn.Module:
    """The innermost wrapped layer (for code that looks for parallel layers by type)."""
    while (inner := style_target(module)) is not module:
        module = inner
    return module


def plan_root(model: nn.Module) -> nn.Module:
    """The model a plan names: the transformers model inside an adapter wrapper (PEFT's `PeftModel`), else `model`.
    Plan keys and pipeline split specs are written against the transformers model's own module names."""
    if hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None)):
        return model.get_base_model()
    return model
