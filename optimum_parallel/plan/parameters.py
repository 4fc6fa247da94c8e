"""The caller's parameter objects survive parallelization: an optimizer built on `model.parameters()` before
`parallelize` steps the parallel model, as one rebuilt by `optimizer_for_mp` would.

Tensor and expert parallelism give each original `nn.Parameter` its shard (`keep_original_parameters`). Where a
parameter cannot be kept (FSDP2 replaces every parameter with a DTensor of its own), the old one is marked
(`mark_replaced`), and any optimizer that still holds it raises at its first step, naming what to do instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

_REPLACED = "_optimum_parallel_replaced_by"  # on a parameter the model no longer holds: why
_hook_installed = False


def keep_original_parameters(
    model: nn.Module, originals: Mapping[int, nn.Parameter], mapping: Mapping[int, nn.Parameter | None]
) -> dict[int, nn.Parameter | None]:
    """Put every original parameter (`originals`: {id: parameter}) back into `model` in place of the parallel one
    `mapping` gave it, holding that one's data (its shard) and attributes (`shard_layout`, `expert_layout`): every
    module that held the parallel parameter (tied weights included) holds the original again. Returns the mapping
    with each kept parameter mapped to itself."""
    swaps: dict[int, nn.Parameter] = {}  # id(parallel parameter) -> the original that takes its place
    for key, new in mapping.items():
        original = originals.get(key)
        if new is None or original is None or new is original or id(new) in swaps:
            continue
        original.grad = None  # a gradient of the whole tensor would not fit the shard
        original.data = new.data
        original.__dict__.clear()
        original.__dict__.update(new.__dict__)
        original.requires_grad_(new.requires_grad)
        swaps[id(new)] = original
    if swaps:
        for module in model.modules():
            for leaf, param in list(module._parameters.items()):
                if param is not None and id(param) in swaps:
                    module._parameters[leaf] = swaps[id(param)]
    return {key: (swaps.get(id(new), new) if new is not None else None) for key, new in mapping.items()}


def mark_replaced(params: Iterable[nn.Parameter], why: str) -> None:
    """`params` are no longer the model's (FSDP2 replaced them): an optimizer stepping them raises, saying `why`."""
    global _hook_installed
    for param in params:
        setattr(param, _REPLACED, why)
    if not _hook_installed:
        _hook_installed = True
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_refuse_replaced)


def _refuse_replaced(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            why = getattr(param, _REPLACED, None)
            if why is not None:
                raise RuntimeError(
                    f"this {type(optimizer).__name__} steps parameters the parallel model no longer holds ({why}): it "
                    "was built before parallelization. Pass it to op.parallelize(model, optimizer, mesh, config) and "
                    "step the optimizer it returns, or rebuild it with Parallelizer.optimizer_for_mp(optimizer, "
                    "model.orig_param_to_parallel_param) (ParallelTrainer does this for you)"
                )
