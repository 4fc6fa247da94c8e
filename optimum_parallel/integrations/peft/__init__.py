"""PEFT: adapters on a tensor-parallel model, in either order (`get_peft_model` then `parallelize`, or after it).

`register()` (run by `import optimum_parallel`) tells the plan how to split a PEFT layer wrapping a module the plan
names. The first plan applied also teaches PEFT to wrap this package's parallel layers, so `get_peft_model` on a
model parallelized before works too. Nothing here imports peft until a PEFT layer or model is met.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

from ...plan.wrappers import WrapperHandler, register_wrapper_handler
from .lora import check_planned_wrapper, is_peft_layer, link_lora_siblings, shard_lora_layer


def _parallelize(wrapper, ctx) -> None:
    rank, world = ctx.tp_rank_world
    shard_lora_layer(wrapper, rank, world)


def _after_apply(model, ctx) -> None:
    link_lora_siblings(model)
    after_import("peft", _install_dispatch)  # importing peft costs ~0.4 s: a model without adapters never pays it


def _install_dispatch() -> None:
    from .peft_patches import install_peft_dispatch

    install_peft_dispatch()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `callback` right after the first import of module `name` (and removes itself)."""

    def __init__(self, name: str, callback) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            execute, callback = spec.loader.exec_module, self.callback

            def exec_module(module) -> None:
                execute(module)
                callback()

            spec.loader.exec_module = exec_module
        return spec


def after_import(name: str, callback) -> None:
    """`callback()` now if module `name` is imported, else right after its import (nothing if not installed)."""
    if name in sys.modules:
        callback()
    elif importlib.util.find_spec(name) is not None and not any(
        isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _AfterImport(name, callback))


def register() -> None:
    register_wrapper_handler(WrapperHandler("peft", is_peft_layer, _parallelize, _after_apply, check_planned_wrapper))
