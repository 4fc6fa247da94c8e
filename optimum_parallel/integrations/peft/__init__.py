"""PEFT: adapters on a tensor-parallel model, in either order (`get_peft_model` then `parallelize`, or after it).

`register()` (run by `import optimum_parallel`) tells the plan how to split a PEFT layer wrapping a module the plan
names. The first plan applied also teaches PEFT to wrap this package's parallel layers, so `get_peft_model` on a
model parallelized before works too. Nothing here imports peft until a PEFT layer or model is met.
"""

from __future__ import annotations

import importlib.util

from ...plan.wrappers import WrapperHandler, register_wrapper_handler
from .lora import check_planned_wrapper, is_peft_layer, link_lora_siblings, shard_lora_layer


def _parallelize(wrapper, ctx) -> None:
    rank, world = ctx.tp_rank_world
    shard_lora_layer(wrapper, rank, world)


def _after_apply(model, ctx) -> None:
    link_lora_siblings(model)
    if importlib.util.find_spec("peft") is not None:
        from .dispatch import install_peft_dispatch

        install_peft_dispatch()


def register() -> None:
    register_wrapper_handler(WrapperHandler("peft", is_peft_layer, _parallelize, _after_apply, check_planned_wrapper))
