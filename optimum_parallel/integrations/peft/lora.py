"""LoRA (PEFT) adapters on tensor-parallel layers, split by the base layer's style.

Column-parallel base (output features split): A is replicated and B split on its output dim exactly like the
base weight (head parts included). The adapter reads the same entered input as the base layer, so the input
gradient of both is all-reduced in the base layer's one backward collective. A's gradient is a sum over the
output shards: it is all-reduced over tp (one parameter-sized r x in all-reduce per adapter, like a
sequence-parallel norm's weight).

Row-parallel base (input features split): A is split on its input dim and B replicated. The adapter's partial
product A_local x_local joins the base layer's all-reduce (reduce-scatter under sequence parallelism):
[W_local x_local | A_local x_local] go through one collective and B applies to the summed A x, so the adapter
adds no collective and B's gradient is complete (summed over tp only under sequence parallelism, where each rank
sees a slice of the sequence).

Dropout on the adapter input draws its mask on each rank; on a column-parallel base the input is replicated, so
each output shard sees its own mask (a valid dropout, not the single-device one: compare with dropout 0).
Merging (`merge_and_unload`) works shard by shard: B_local A and B A_local have the local weight's shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...comm.overlapped_entry import enter_region
from ...comm.regions import (
    copy_to_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from ...tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ...tensor_parallel.packed import PackedColumnParallelLinear
from ...tensor_parallel.spec import ShardSpec, local_parameter

SUPPORTED = "LoRA on Linear layers (peft.tuners.lora.Linear)"


def _lora_linear_class() -> type:
    from peft.tuners.lora import Linear

    return Linear


def is_peft_layer(module: nn.Module) -> bool:
    """A PEFT tuner layer (it wraps its `base_layer`); found without importing peft."""
    from_peft = any(cls.__module__.startswith("peft.") for cls in type(module).__mro__)
    return from_peft and isinstance(getattr(module, "base_layer", None), nn.Module)


def _check_supported(wrapper: nn.Module) -> None:
    base = wrapper.base_layer
    if not isinstance(wrapper, _lora_linear_class()):
        raise NotImplementedError(
            f"{type(wrapper).__module__}.{type(wrapper).__qualname__} on a tensor-parallel layer is not supported; "
            f"supported: {SUPPORTED}"
        )
    if isinstance(base, PackedColumnParallelLinear) or not isinstance(base, (ColumnParallelLinear, RowParallelLinear)):
        raise NotImplementedError(
            f"LoRA on a {type(base).__name__} is not supported; supported bases: ColumnParallelLinear and "
            "RowParallelLinear (not packed q|k|v or gate|up layers): leave this module out of target_modules"
        )
    if isinstance(base, ColumnParallelLinear) and base.gather_output:
        raise NotImplementedError("LoRA on a column-parallel layer that gathers its output is not supported")
    if isinstance(base, RowParallelLinear) and not base.input_is_parallel:
        raise NotImplementedError("LoRA on a row-parallel layer that splits its own input is not supported")
    if wrapper.lora_variant:
        raise NotImplementedError(
            f"LoRA variants {sorted(type(v).__name__ for v in wrapper.lora_variant.values())} (DoRA, ...) are not "
            f"supported under tensor parallelism; supported: {SUPPORTED} without use_dora"
        )
    if any(b.bias is not None for b in wrapper.lora_B.values()):
        raise NotImplementedError("LoRA with lora_bias=True is not supported under tensor parallelism")


def _shard(module: nn.Linear, spec: ShardSpec, rank: int, tp: int) -> None:
    module.weight = local_parameter(module.weight, spec.local(rank, tp), module.weight.requires_grad)


def shard_lora_layer(wrapper: nn.Module, rank: int, tp: int) -> None:
    """Split the adapters of a PEFT LoRA layer whose `base_layer` is already tensor-parallel; swap its forward."""
    _check_supported(wrapper)
    base = wrapper.base_layer
    base_spec = base.weight.shard_layout.spec
    for name in wrapper.lora_A:
        a, b = wrapper.lora_A[name], wrapper.lora_B[name]
        if getattr(b.weight, "shard_layout", None) is not None or getattr(a.weight, "shard_layout", None) is not None:
            continue  # already split (parallelized twice, or an adapter added after the split)
        if isinstance(base, ColumnParallelLinear):
            _shard(b, ShardSpec(tuple(b.weight.shape), 0, base_spec.parts), rank, tp)
        else:
            _shard(a, ShardSpec(tuple(a.weight.shape), 1, base_spec.parts), rank, tp)
    wrapper.__class__ = _parallel_class(type(wrapper))


_PARALLEL_CLASSES: dict[type, type] = {}


def _parallel_class(cls: type) -> type:
    if cls in _PARALLEL_CLASSES.values():
        return cls
    if cls not in _PARALLEL_CLASSES:
        _PARALLEL_CLASSES[cls] = type(f"TensorParallel{cls.__name__}", (cls,), {"forward": _forward})
    return _PARALLEL_CLASSES[cls]


def _forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    self._check_forward_args(x, *args, **kwargs)
    if kwargs.pop("adapter_names", None) is not None:
        raise NotImplementedError(
            "mixed-adapter batches (adapter_names=...) are not supported under tensor parallelism"
        )
    active = [name for name in self.active_adapters if name in self.lora_A]
    if self.disable_adapters and self.merged:
        self.unmerge()
    if self.disable_adapters or self.merged or not active:
        return self.base_layer(x, *args, **kwargs)
    if isinstance(self.base_layer, ColumnParallelLinear):
        return _column_forward(self, x, active)
    return _row_forward(self, x, active)


def _column_forward(self, x: torch.Tensor, active: list[str]) -> torch.Tensor:
    base = self.base_layer
    entered = enter_region(x, base.group, base.sequence_parallel) if base.enter_region else x
    weight, bias = base.weight, base.bias
    if base.replica_group is not None:  # replicated heads: their gradients are summed over the replicas
        weight = copy_to_tensor_parallel_region(weight, base.replica_group)
        bias = copy_to_tensor_parallel_region(bias, base.replica_group) if bias is not None else None
    result = F.linear(entered, weight, bias)
    for name in active:
        a = copy_to_tensor_parallel_region(self.lora_A[name].weight, base.group)  # A's gradient: summed over tp
        b = self.lora_B[name].weight
        if base.replica_group is not None:
            b = copy_to_tensor_parallel_region(b, base.replica_group)
        hidden = self.lora_dropout[name](entered.to(a.dtype))
        result = result + (F.linear(F.linear(hidden, a), b) * self.scaling[name]).to(result.dtype)
    return result


def _row_forward(self, x: torch.Tensor, active: list[str]) -> torch.Tensor:
    base = self.base_layer
    partial = [F.linear(x, base.weight)]
    for name in active:
        a = self.lora_A[name].weight
        partial.append(F.linear(self.lora_dropout[name](x.to(a.dtype)), a).to(partial[0].dtype))
    joined = torch.cat(partial, dim=-1)  # the adapters' A x join the base layer's one collective
    if base.sequence_parallel:
        joined = reduce_scatter_to_sequence_parallel_region(joined, base.group)
    else:
        joined = reduce_from_tensor_parallel_region(joined, base.group)
    out = base.weight.shape[0]
    result = joined[..., :out]
    if base.bias is not None:
        result = result + base.bias
    offset = out
    for name in active:
        b = self.lora_B[name].weight
        rank = b.shape[1]
        if base.sequence_parallel:  # each rank saw a slice of the sequence: B's gradient is summed over tp
            b = copy_to_tensor_parallel_region(b, base.group)
        result = result + (F.linear(joined[..., offset : offset + rank].to(b.dtype), b) * self.scaling[name]).to(
            result.dtype
        )
        offset += rank
    return result
