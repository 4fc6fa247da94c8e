"""Tensor-parallel mixture-of-experts: every expert's intermediate dim is split over tp.

transformers 5 stores experts as 3D tensors (`gate_up_proj` [E, 2I, H] packed gate|up, `down_proj`
[E, H, I], or their transposes). Each rank keeps its slice of every expert's intermediate features,
so the routing (replicated router, same top-k on every rank) is untouched and every rank does the
same share of work whatever the routing. The experts module becomes one tp region: its inputs
(hidden states and routing weights) enter with a backward all-reduce, its partial output is
all-reduced. The router stays outside the region, so its gradient is already complete.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..comm.overlapped_entry import enter_region
from ..comm.regions import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region
from .spec import ShardLayout, ShardSpec, local_parameter


def expert_specs(module: nn.Module, packed: Sequence[str], row: Sequence[str]) -> dict[str, ShardSpec]:
    """Specs of the expert tensors: `packed` ones split gate|up each on its own, `row` ones on their input dim."""
    transposed = bool(getattr(module, "is_transposed", False))
    specs = {}
    for name in packed:
        shape = tuple(getattr(module, name).shape)
        dim = len(shape) - 1 if transposed else len(shape) - 2
        if getattr(module, "is_concatenated", True):
            specs[name] = ShardSpec.packed(shape, dim, [shape[dim] // 2] * 2, [None, None])
        else:  # interleaved gate0, up0, gate1, up1...: whole (gate, up) pairs
            specs[name] = ShardSpec.split(shape, dim, shape[dim] // 2)
    for name in row:
        shape = tuple(getattr(module, name).shape)
        specs[name] = ShardSpec.split(shape, len(shape) - 2 if transposed else len(shape) - 1)
    return specs


def shard_experts(module: nn.Module, layouts: dict[str, ShardLayout], group: ProcessGroup) -> nn.Module:
    """Replace the expert tensors of `module` by their local shards and make the module one tp region."""
    for name, layout in layouts.items():
        param = getattr(module, name)
        setattr(module, name, local_parameter(param, layout, param.requires_grad))
    module.tp_group = group
    module.register_forward_pre_hook(_enter_experts_region, with_kwargs=True)
    module.register_forward_hook(_exit_experts_region)
    return module


_ROUTING_WEIGHT_NAMES = ("top_k_weights", "routing_weights")


def _enter_experts_region(module: nn.Module, args: tuple, kwargs: dict):
    group = module.tp_group
    args = list(args)
    if args:
        args[0] = enter_region(args[0], group, False)
    elif "hidden_states" in kwargs:
        kwargs["hidden_states"] = enter_region(kwargs["hidden_states"], group, False)
    if len(args) >= 3 and torch.is_tensor(args[2]) and args[2].is_floating_point():
        args[2] = copy_to_tensor_parallel_region(args[2], group)
    for name in _ROUTING_WEIGHT_NAMES:
        if torch.is_tensor(kwargs.get(name)):
            kwargs[name] = copy_to_tensor_parallel_region(kwargs[name], group)
    return tuple(args), kwargs


def _exit_experts_region(module: nn.Module, args: tuple, output):
    if torch.is_tensor(output):
        return reduce_from_tensor_parallel_region(output, module.tp_group)
    if isinstance(output, tuple) and output and torch.is_tensor(output[0]):
        return (reduce_from_tensor_parallel_region(output[0], module.tp_group), *output[1:])
    raise TypeError(f"tensor-parallel experts expected a tensor output, got {type(output).__name__}")
