"""A token mixer's heads split once more, over the cp ranks, while its weights stay whole on each of them.

`split_heads` gives a tp-split mixer this cp rank's heads: each parameter the tp plan splits by heads is read through a
property returning this cp rank's slice (`sliced_class`), and the forward's size attributes take the cp-local sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..comm.collectives import all_reduce
from ..styles.mixer import local_units
from ..tensor_parallel.packed_linear import sum_segment_grads
from ..tensor_parallel.spec import ShardLayout, ShardSpec
from .plan import MixerSpec

_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def tp_local_spec(spec: ShardSpec, rank: int, tp: int) -> ShardSpec:
    """The spec of what tp rank `rank` holds of a tensor split by `spec`, as a packed tensor of its own (each part's
    local rows, in the heads it holds: `local_units`), so that cutting it again over cp uses the same rules."""
    layout = spec.local(rank, tp)
    parts = []
    for (_, heads), (start, end) in zip(spec.parts, layout.ranges, strict=True):
        parts.append((end - start, None if heads is None else local_units(heads, tp)))
    shape = list(spec.global_shape)
    shape[spec.dim] = sum(size for size, _ in parts)
    return ShardSpec(tuple(shape), spec.dim, tuple(parts))


@dataclass(frozen=True)
class _Slice:
    """This cp rank's part of a tp-local tensor: gradient rows of tp-replicated heads summed first, then cut."""

    layout: ShardLayout
    segments: tuple = ()

    def __call__(self, local: torch.Tensor) -> torch.Tensor:
        if self.segments:
            local = sum_segment_grads(local, self.layout.dim, self.segments)
        return self.layout.slice(local)


class _FirstRankOnly:
    """A bias added after partial sums that cp will add up: rank 0's value, zeros (no gradient) elsewhere."""

    def __init__(self, first: bool) -> None:
        self.first = first

    def __call__(self, bias: torch.Tensor) -> torch.Tensor:
        return bias if self.first else torch.zeros_like(bias)


def _sliced(name: str):
    def read(self):
        value = self._parameters[name] if name in self._parameters else self._buffers.get(name)
        if value is None or hasattr(value, "_local_tensor"):  # FSDP2's sharded parameter is read as it is
            return value
        return self._optimum_parallel_cp_slices[name](value)

    def write(self, value):
        nn.Module.__setattr__(self, name, value)

    return property(read, write)


def sliced_class(cls: type, names: tuple[str, ...], extra: dict | None = None) -> type:
    """`cls` with each of `names` read through this cp rank's slice (and `extra` class attributes: the runner's
    forward); one class per (class, names)."""
    key = (cls, names, tuple(sorted(extra or {})))
    if key not in _CLASSES:
        attrs = {name: _sliced(name) for name in names}
        _CLASSES[key] = type(cls.__name__, (cls,), {**attrs, **(extra or {}), "__module__": cls.__module__})
    return _CLASSES[key]


class _SumBothWays(torch.autograd.Function):
    """All-reduce forward and backward: a partial output every rank's heads read whole."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.clone(), ctx.group), None


def _sum_output(group: ProcessGroup):
    def hook(module, args, output):
        return _SumBothWays.apply(output, group) if torch.is_grad_enabled() else all_reduce(output.clone(), group)

    return hook


def _owner(mixer: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    path, _, leaf = dotted.rpartition(".")
    return (mixer.get_submodule(path) if path else mixer), leaf


def split_heads(mixer: nn.Module, spec: MixerSpec, tp: tuple[int, int], cp: tuple[int, int], group: ProcessGroup):
    """Give `mixer` (already tp-split by its plan) this cp rank's heads, `tp` and `cp` being (rank, size) pairs;
    returns {module: names its class must read through slices} for the caller to swap the classes once."""
    (tp_rank, tp_size), (cp_rank, cp_size) = tp, cp
    names: dict[nn.Module, list[str]] = {}

    def add(dotted: str, value) -> None:
        module, leaf = _owner(mixer, dotted)
        module.__dict__.setdefault("_optimum_parallel_cp_slices", {})[leaf] = value
        names.setdefault(module, []).append(leaf)

    moved_segments = {}
    for dotted, global_spec in {**spec.params, **spec.buffers}.items():
        module, _ = _owner(mixer, dotted)
        layout = tp_local_spec(global_spec, tp_rank, tp_size).local(cp_rank, cp_size)
        segments = tuple(getattr(module, "segments", ()) or ()) if dotted in spec.params else ()
        if segments:
            moved_segments[module] = segments
        add(dotted, _Slice(layout, segments))
    for module in moved_segments:  # now summed before the slice: the layer must not sum its sliced rows again
        module.segments = ()
    for dotted in spec.exit_biases:
        add(dotted, _FirstRankOnly(cp_rank == 0))
    for dotted, counts in spec.attrs.items():
        owner, leaf = _owner(mixer, dotted)
        setattr(owner, leaf, sum(local_units(local_units(units, tp_size), cp_size) * size for units, size in counts))
    for dotted in spec.convs:
        conv = mixer.get_submodule(dotted)
        layout = conv._optimum_parallel_cp_slices["weight"].layout
        conv.in_channels = conv.out_channels = conv.groups = layout.local_shape[0]
    for dotted in spec.inner_rows:
        mixer.get_submodule(dotted).register_forward_hook(_sum_output(group))
    for module in mixer.modules():
        if getattr(module, "defers_weight_grads", False):  # its weight is a fresh slice each read: nothing to alias
            module.defers_weight_grads = False
    return {module: tuple(leaves) for module, leaves in names.items()}
