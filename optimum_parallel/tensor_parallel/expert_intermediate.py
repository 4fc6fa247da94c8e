"""Tensor-parallel mixture-of-experts: every expert's intermediate dim is split over tp.

`expert_specs` gives the specs of transformers 5's 3D expert tensors and their biases; `shard_experts` replaces them
by their local shards and makes the experts module one tp region (inputs entered with a backward all-reduce, the
partial output all-reduced).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..comm.autograd_collectives import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region
from ..comm.tp_entry import RegionEntry
from ..mesh import ranks
from .spec import ShardLayout, ShardSpec, local_parameter


def bias_of(module: nn.Module, name: str) -> str | None:
    """The name of the bias of expert tensor `name` (transformers' `<name>_bias`), None when it has none."""
    bias = f"{name}_bias"
    return bias if isinstance(module._parameters.get(bias), nn.Parameter) else None


def _packed_spec(shape: tuple[int, ...], dim: int, concatenated: bool) -> ShardSpec:
    if concatenated:  # gate | up: each half split on its own
        return ShardSpec.packed(shape, dim, [shape[dim] // 2] * 2, [None, None])
    return ShardSpec.split(shape, dim, shape[dim] // 2)  # interleaved gate0, up0, gate1, up1...: whole pairs


def expert_specs(
    module: nn.Module, packed: Sequence[str], row: Sequence[str], transposed: bool | None = None
) -> dict[str, ShardSpec]:
    """Specs of the expert tensors: `packed` ones split gate|up each on its own, `row` ones on their input dim;
    a packed tensor's bias split like its output features, a row tensor's bias whole (added once: `add_once`).
    `transposed`: the tensors are [E, in, out] (None: the module's `is_transposed`)."""
    if transposed is None:
        transposed = bool(getattr(module, "is_transposed", False))
    concatenated = bool(getattr(module, "is_concatenated", True))
    specs = {}
    for name in packed:
        shape = tuple(getattr(module, name).shape)
        specs[name] = _packed_spec(shape, len(shape) - 1 if transposed else len(shape) - 2, concatenated)
        bias = bias_of(module, name)
        if bias is not None:
            bias_shape = tuple(getattr(module, bias).shape)
            specs[bias] = _packed_spec(bias_shape, len(bias_shape) - 1, concatenated)
    for name in row:
        shape = tuple(getattr(module, name).shape)
        specs[name] = ShardSpec.split(shape, len(shape) - 2 if transposed else len(shape) - 1)
        bias = bias_of(module, name)
        if bias is not None:
            specs[bias] = ShardSpec(tuple(getattr(module, bias).shape))
    return specs


def shard_experts(
    module: nn.Module,
    layouts: dict[str, ShardLayout],
    group: ProcessGroup,
    add_once: Sequence[str] = (),
    entry: RegionEntry | None = None,
) -> nn.Module:
    """Replace the expert tensors of `module` by their local shards and make the module one tp region, entered
    through `entry` (the model's: a shared expert reading the same input shares it); the whole biases named in
    `add_once` (those of row tensors, added after the partial sums) count once."""
    for name, layout in layouts.items():
        param = getattr(module, name)
        setattr(module, name, local_parameter(param, layout, param.requires_grad))
    module.tp_group = group
    module.tp_entry = entry or RegionEntry()
    if add_once:
        _add_biases_once(module, tuple(add_once))
    module.register_forward_pre_hook(_enter_experts_region, with_kwargs=True)
    module.register_forward_hook(_exit_experts_region)
    return module


_ADD_ONCE_CLASSES: dict[type, type] = {}


def _add_biases_once(module: nn.Module, names: tuple[str, ...]) -> None:
    """Make `module`'s forward (its class's, which expert parallelism also calls) see the biases `names` times 1 on
    tp rank 0 and times 0 elsewhere, so the region's all-reduce adds each once; they enter through an identity whose
    backward all-reduces, so every rank holds the whole gradient (rank 0's part)."""
    cls = type(module)
    if cls not in _ADD_ONCE_CLASSES.values():
        if cls not in _ADD_ONCE_CLASSES:

            def forward(self, *args, **kwargs):
                originals = {name: self._parameters[name] for name in self._add_once}
                first = int(ranks.rank(self.tp_group) == 0)
                try:
                    for name, bias in originals.items():
                        keep = ranks.device_scalar(first, bias.device)  # data on XLA: one graph for every rank
                        self._parameters[name] = copy_to_tensor_parallel_region(bias, self.tp_group) * keep
                    return cls.forward(self, *args, **kwargs)
                finally:
                    self._parameters.update(originals)

            _ADD_ONCE_CLASSES[cls] = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})
        module.__class__ = _ADD_ONCE_CLASSES[cls]
    module._add_once = names


_ROUTING_WEIGHT_NAMES = ("top_k_weights", "routing_weights")


def _enter_experts_region(module: nn.Module, args: tuple, kwargs: dict):
    group = module.tp_group
    args = list(args)
    if args:
        args[0] = module.tp_entry(args[0], group, False)
    elif "hidden_states" in kwargs:
        kwargs["hidden_states"] = module.tp_entry(kwargs["hidden_states"], group, False)
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
