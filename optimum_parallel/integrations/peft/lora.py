"""LoRA (PEFT) adapters on tensor-parallel layers, split by the base layer's style (`shard_lora_layer`): A replicated
and B split on a column-parallel base, A split and B replicated on a row-parallel one, the adapters' products carried
by the base layer's own collectives. `check_lora_target`, `check_planned_wrapper` and `check_adapter_targets` refuse
targets LoRA cannot adapt here; `link_lora_siblings` links the column layers that read one input. Design notes:
docs/module_notes.md.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ...comm.autograd_collectives import (
    copy_to_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from ...mesh import ranks
from ...tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ...tensor_parallel.packed_linear import PackedColumnParallelLinear, sum_segment_grads
from ...tensor_parallel.spec import ShardSpec, local_parameter, shard_sizes

if TYPE_CHECKING:
    from ...comm.tp_entry import RegionEntry

SUPPORTED = "LoRA on Linear layers (peft.tuners.lora.Linear)"


def _lora_linear_class() -> type:
    from peft.tuners.lora import Linear

    return Linear


def is_peft_layer(module: nn.Module) -> bool:
    """A PEFT tuner layer (it wraps its `base_layer`); found without importing peft."""
    from_peft = any(cls.__module__.startswith("peft.") for cls in type(module).__mro__)
    return from_peft and isinstance(getattr(module, "base_layer", None), nn.Module)


def is_parallel_lora(module: nn.Module) -> bool:
    """A PEFT LoRA layer whose adapters were split over tp by `shard_lora_layer`."""
    return type(module) in _PARALLEL_CLASSES.values()


def _unsupported_base(base: type, name: str, *, gather_output: bool, lm_head: bool) -> str:
    """Why LoRA cannot adapt `name` once it is a `base` layer, or "" if it can: the one refusal both orders use
    (`get_peft_model` then parallelize: checked with the plan; parallelize then `get_peft_model`: in the dispatch)."""
    if lm_head and issubclass(base, ColumnParallelLinear):
        return (
            f"LoRA on the vocab-parallel LM head {name!r} ({base.__name__}, logits split over tp) is not supported "
            f"yet; leave it out of target_modules. Supported: {SUPPORTED} on every other ColumnParallelLinear "
            "(q/k/v, gate/up, packed or not) and RowParallelLinear (o_proj, down_proj)"
        )
    if not issubclass(base, (ColumnParallelLinear, RowParallelLinear)):
        return (
            f"LoRA on {name!r} ({base.__name__}) is not supported; supported bases: ColumnParallelLinear (packed "
            "q|k|v or gate|up included) and RowParallelLinear (not embeddings or experts): leave this module out "
            "of target_modules"
        )
    if issubclass(base, PackedColumnParallelLinear) and gather_output:
        return f"LoRA on {name!r}: a packed column-parallel layer cannot gather its output (its parts interleave)"
    return ""


def check_lora_target(base: nn.Module, name: str) -> None:
    """Refuse LoRA on a parallel layer it does not support (`get_peft_model` on a parallel model)."""
    reason = _unsupported_base(
        type(base),
        name,
        gather_output=getattr(base, "gather_output", False),
        lm_head=hasattr(base, "logits_mode"),  # the vocab-parallel head (plan/caller_outputs.py sets it)
    )
    if reason:
        raise NotImplementedError(reason)


def _wrapper_supported(wrapper: nn.Module) -> None:
    if not isinstance(wrapper, _lora_linear_class()):
        raise NotImplementedError(
            f"{type(wrapper).__module__}.{type(wrapper).__qualname__} on a tensor-parallel layer is not supported; "
            f"supported: {SUPPORTED}"
        )
    if wrapper.lora_variant:
        raise NotImplementedError(
            f"LoRA variants {sorted(type(v).__name__ for v in wrapper.lora_variant.values())} (DoRA, ...) are not "
            f"supported under tensor parallelism; supported: {SUPPORTED} without use_dora"
        )
    if any(b.bias is not None for b in wrapper.lora_B.values()):
        raise NotImplementedError(
            "LoRA with lora_bias=True is not supported under tensor parallelism; supported: lora_bias=False"
        )


def check_planned_wrapper(wrapper: nn.Module, styles: list, name: str, lm_head: bool) -> None:
    """`get_peft_model`, then parallelize: refuse a PEFT layer whose base the plan would swap for a layer LoRA here
    does not support, before the plan changes anything (the same refusal as `_check_supported` after the swap)."""
    if any(s.swaps_module for s in styles):
        _wrapper_supported(wrapper)
        _check_planned_layer(wrapper.base_layer, styles, name, lm_head)


def check_adapter_targets(model: nn.Module, plan: Mapping[str, object], peft_config) -> None:
    """`peft_config`'s targets against what `plan` will make of them, before anything changes (the Trainer adds the
    adapters once the base is split, so `get_peft_model`'s own refusal would come after the split)."""
    from peft.tuners import tuners_utils
    from peft.tuners.tuners_utils import check_target_module_exists

    from ...plan.apply import resolve_plan

    # "all-linear" as PEFT resolves it on this model, not yet split (a private function: internals.py names it, and
    # dispatch.py reaches it through that registry); on a copy, as PEFT resolves the user's config itself later
    peft_config = tuners_utils._maybe_include_all_linear_layers(copy.copy(peft_config), model)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    for name, styles in resolve_plan(model, plan).items():
        if check_target_module_exists(peft_config, name):
            layer = model.get_submodule(name)
            _check_planned_layer(layer, styles, name, layer is head)


def _check_planned_layer(layer: nn.Module, styles: list, name: str, lm_head: bool) -> None:
    """Refuse a LoRA target whose layer the plan would swap for one LoRA here does not support."""
    from ...styles import ColWiseParallel, PackedColWiseParallel, RowWiseParallel

    swapping = [s for s in styles if s.swaps_module]
    if not swapping:
        return
    style = swapping[-1]
    if isinstance(style, ColWiseParallel):
        base = ColumnParallelLinear
    elif isinstance(style, PackedColWiseParallel) and isinstance(layer, nn.Linear):
        base = PackedColumnParallelLinear
    elif isinstance(style, RowWiseParallel) and isinstance(layer, nn.Linear):
        base = RowParallelLinear
    else:
        base = type(style)  # packed, embedding, expert and other swaps
    reason = _unsupported_base(
        base,
        name,
        gather_output=getattr(style, "gather_output", False),
        lm_head=lm_head and not getattr(style, "gather_output", False),
    )
    if reason:
        raise NotImplementedError(reason)


def _check_supported(wrapper: nn.Module) -> None:
    _wrapper_supported(wrapper)
    check_lora_target(wrapper.base_layer, type(wrapper.base_layer).__name__)


def _shard(module: nn.Linear, spec: ShardSpec, rank: int, tp: int) -> None:
    module.weight = local_parameter(module.weight, spec.local(rank, tp), module.weight.requires_grad)
    module.register_load_state_dict_pre_hook(_slice_whole_weight)


def _slice_whole_weight(module: nn.Linear, state_dict: dict, prefix: str, *_) -> None:
    """A standard (whole-tensor) PEFT adapter loads onto a split adapter: this rank keeps its slice."""
    layout, key = module.weight.shard_layout, prefix + "weight"
    whole = state_dict.get(key)
    if whole is not None and tuple(whole.shape) == layout.global_shape != tuple(module.weight.shape):
        state_dict[key] = layout.slice(whole)


def shard_lora_layer(wrapper: nn.Module, rank: int, tp: int) -> None:
    """Split the adapters of a PEFT LoRA layer whose `base_layer` is already tensor-parallel; swap its forward."""
    _check_supported(wrapper)
    if any(p.is_meta for p in (*wrapper.lora_A.parameters(), *wrapper.lora_B.parameters())):
        raise NotImplementedError(
            "LoRA adapters made on the meta device (get_peft_model under lazy_load_for_parallelism) have no values "
            "to load: load the base lazily, parallelize it, then call get_peft_model on the parallel model"
        )
    _split_adapters(wrapper, rank, tp)
    wrapper.base_layer.__dict__["_lora_wrapper"] = weakref.ref(wrapper)
    wrapper.__class__ = _parallel_class(type(wrapper))


def _split_adapters(wrapper: nn.Module, rank: int, tp: int) -> None:
    """Split every adapter of `wrapper` that is still whole, by its base layer's spec."""
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


_PARALLEL_CLASSES: dict[type, type] = {}


def _parallel_class(cls: type) -> type:
    if cls in _PARALLEL_CLASSES.values():
        return cls
    if cls not in _PARALLEL_CLASSES:
        methods = {"forward": _forward, "update_layer": _update_layer}
        _PARALLEL_CLASSES[cls] = type(f"TensorParallel{cls.__name__}", (cls,), methods)
    return _PARALLEL_CLASSES[cls]


def _update_layer(self, adapter_name: str, *args, **kwargs) -> None:
    """A further adapter on a split layer (`add_adapter`, `load_adapter`) is made whole, as on one device, then
    split like the first."""
    super(type(self), self).update_layer(adapter_name, *args, **kwargs)
    _check_supported(self)
    group = self.base_layer.group
    _split_adapters(self, ranks.rank(group), ranks.world_size(group))


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


@dataclass
class _JoinedEntry:
    """x and the adapters' u = A x of a block's column layers, entered into the tp region in one collective."""

    source: weakref.ref | None
    version: int
    entered: torch.Tensor  # x inside the region
    adapters: dict[tuple[int, str], torch.Tensor]  # (id(layer), adapter) -> its u inside the region


# the last joined entry of each region entry (one per model, and per rank where one process runs several): kept here,
# beside the entry's own last one, and gone with the model
_LAST_JOINED: weakref.WeakKeyDictionary[RegionEntry, _JoinedEntry] = weakref.WeakKeyDictionary()


def _joined_entry(self, x: torch.Tensor, active: list[str]) -> _JoinedEntry:
    """The block's entry of `x` with the u of every active adapter of this layer and its siblings (the last one is
    kept per region entry, `_LAST_JOINED`)."""
    entry = self.base_layer.wiring.entry
    last = _LAST_JOINED.get(entry)
    if (
        last is not None
        and last.source() is x
        and last.version == x._version
        and (id(self), active[0]) in last.adapters
    ):
        return last
    base = self.base_layer
    sequence_parallel = base.wiring.splits_sequence()  # a decode step leaves the sequence whole
    layers = [self] + [s for s in _siblings(self) if s is not self]
    keys, parts = [], [x]
    for layer in layers:
        for name in (n for n in layer.active_adapters if n in layer.lora_A):
            a = layer.lora_A[name].weight
            if sequence_parallel:  # A x on a slice of the sequence: A's gradient is summed over tp
                a = copy_to_tensor_parallel_region(a, base.group)
            keys.append(((id(layer), name), a.shape[0]))
            parts.append(F.linear(layer.lora_dropout[name](x.to(a.dtype)), a).to(x.dtype))
    joined = entry(torch.cat(parts, dim=-1), base.group, sequence_parallel)
    hidden = x.shape[-1]
    entered, adapters, offset = joined[..., :hidden], {}, hidden
    for key, rank in keys:
        adapters[key] = joined[..., offset : offset + rank]
        offset += rank
    entry.remember(x, base.group, sequence_parallel, entered)  # plain siblings reuse the entry
    joined = _JoinedEntry(weakref.ref(x), x._version, entered, adapters)
    if entered.requires_grad:
        _LAST_JOINED[entry] = joined
    else:
        _LAST_JOINED.pop(entry, None)
    return joined


def _traced_entry(self, x: torch.Tensor, active: list[str]) -> _JoinedEntry:
    """The entry as torch.compile traces it: x enters as the base layer's would (the compile backend folds it with
    its siblings'), each adapter's u = A x through an entry of its own (a collective of rank-r rows each way)."""
    base = self.base_layer
    entry, sequence_parallel = base.wiring.entry, base.wiring.splits_sequence()
    adapters = {}
    for name in active:
        a = self.lora_A[name].weight
        if sequence_parallel:  # A x on a slice of the sequence: A's gradient is summed over tp
            a = copy_to_tensor_parallel_region(a, base.group)
        u = F.linear(self.lora_dropout[name](x.to(a.dtype)), a).to(x.dtype)
        adapters[name] = entry(u, base.group, sequence_parallel)  # by name: no id() for the graph to guard on
    return _JoinedEntry(None, 0, entry(x, base.group, sequence_parallel), adapters)


def _column_forward(self, x: torch.Tensor, active: list[str]) -> torch.Tensor:
    base = self.base_layer
    key = (lambda name: (id(self), name)) if not torch.compiler.is_compiling() else (lambda name: name)
    if base.wiring.entry is not None and torch.compiler.is_compiling():
        joined = _traced_entry(self, x, active)
        entered, adapters = joined.entered, joined.adapters
    elif base.wiring.entry is not None:
        joined = _joined_entry(self, x, active)
        entered, adapters = joined.entered, joined.adapters
    else:  # the block gathered the whole sequence already (sequence parallelism): A's gradient is summed over tp
        entered, adapters = x, {}
        for name in active:
            a = copy_to_tensor_parallel_region(self.lora_A[name].weight, base.group)
            adapters[key(name)] = F.linear(self.lora_dropout[name](x.to(a.dtype)), a)
    weight, bias = _replicas_summed(base, base.weight), _replicas_summed(base, base.bias)
    result = F.linear(entered, weight, bias)
    for name in active:
        b = _replicas_summed(base, self.lora_B[name].weight)  # B's rows are split like the base weight's
        u = adapters[key(name)]
        result = result + (F.linear(u.to(b.dtype), b) * self.scaling[name]).to(result.dtype)
    return base.gather(result) if base.gather_output else result  # the adapter's output shard gathered with W's


def _replicas_summed(base: ColumnParallelLinear, param: torch.Tensor | None) -> torch.Tensor | None:
    """`param` (split by output rows like the base weight) as the forward uses it: the gradient rows of heads
    replicated over several tp ranks are summed over their replicas (all rows of a replicated shard; on a packed
    layer, the rows of its replicated parts)."""
    if param is None:
        return None
    if base.replica_group is not None:
        return copy_to_tensor_parallel_region(param, base.replica_group)
    if isinstance(base, PackedColumnParallelLinear):
        return sum_segment_grads(param, 0, base.segments)
    return param


def _siblings(layer: nn.Module) -> list[nn.Module]:
    """The column-parallel LoRA layers that may read the same input as `layer` (itself included)."""
    refs = layer.__dict__.get("_lora_siblings")
    if refs is None:  # adapters added after the split: the base layers know their siblings
        base = layer.base_layer
        bases = [base] + [b for b in (base.wiring.siblings.layers if base.wiring.siblings else ()) if b is not base]
        refs = [w for b in bases if (w := b.__dict__.get("_lora_wrapper")) is not None]
    return [s for ref in refs if (s := ref()) is not None]


def link_lora_siblings(model: nn.Module) -> None:
    """Tell every column-parallel LoRA layer the others of its parent module (q/k/v, gate/up): the first of them to
    run carries all their adapter activations through the block's one entry."""
    for parent in model.modules():
        columns = [
            c
            for c in parent.children()
            if isinstance(getattr(c, "base_layer", None), ColumnParallelLinear)
            and type(c) in _PARALLEL_CLASSES.values()
        ]
        for column in columns:
            column.__dict__["_lora_siblings"] = tuple(weakref.ref(c) for c in columns)


def _row_forward(self, x: torch.Tensor, active: list[str]) -> torch.Tensor:
    base = self.base_layer
    if not base.input_is_parallel:  # the layer splits its own input: so does the adapter, which reads the same slice
        x = scatter_to_tensor_parallel_region(
            x, base.group, dim=-1, sizes=shard_sizes(base.in_features, ranks.world_size(base.group))
        )
    partial = [F.linear(x, base.weight)]
    for name in active:
        a = self.lora_A[name].weight
        partial.append(F.linear(self.lora_dropout[name](x.to(a.dtype)), a).to(partial[0].dtype))
    joined = torch.cat(partial, dim=-1)  # the adapters' A x join the base layer's one collective
    sequence_parallel = base.wiring.splits_sequence()
    if sequence_parallel:
        joined = reduce_scatter_to_sequence_parallel_region(joined, base.group)
    else:
        joined = reduce_from_tensor_parallel_region(joined, base.group)
    out = base.weight.shape[0]
    result = joined[..., :out]
    if base.bias is not None:  # on a slice of the sequence, the bias's gradient is summed over tp too
        result = result + (copy_to_tensor_parallel_region(base.bias, base.group) if sequence_parallel else base.bias)
    offset = out
    for name in active:
        b = self.lora_B[name].weight
        rank = b.shape[1]
        if sequence_parallel:  # each rank saw a slice of the sequence: B's gradient is summed over tp
            b = copy_to_tensor_parallel_region(b, base.group)
        result = result + (F.linear(joined[..., offset : offset + rank].to(b.dtype), b) * self.scaling[name]).to(
            result.dtype
        )
        offset += rank
    return result
