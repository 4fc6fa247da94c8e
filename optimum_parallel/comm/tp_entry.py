"""How a tensor-parallel layer enters and leaves its region: one module, the only place that decides it.

`LayerWiring` (what the plan decided for one layer, passed to its constructor, never changed), `RegionEntry` (one per
model: the entry shared by the layers reading one input, its backward collective overlapped with the weight
gradients) and `SequenceRegion` (one per model: whether the running forward splits the sequence). Design notes:
docs/module_notes.md.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from ..mesh import ranks
from .autograd_collectives import (
    SEQ_DIM,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    scatter_to_sequence_parallel_region,
)
from .collectives import all_gather, start_all_reduce, start_reduce_scatter


class _PendingWeightGrads:
    """(grad_output, input) pairs the column layers leave for the entry's backward, one list per weight."""

    def __init__(self, num_weights: int) -> None:
        self.pairs: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(num_weights)]

    def add(self, index: int, grad_output: torch.Tensor, x: torch.Tensor) -> None:
        self.pairs[index].append((grad_output, x))

    def take(self) -> list[torch.Tensor | None]:
        grads = [_weight_grad(pairs) if pairs else None for pairs in self.pairs]
        self.pairs = [[] for _ in self.pairs]
        return grads


def _weight_grad(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    total = None
    for grad_output, x in pairs:
        grad = grad_output.reshape(-1, grad_output.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        total = grad if total is None else total.add_(grad)
    return total


class _OverlappedEntry(torch.autograd.Function):
    """Forward: enter the region (identity or sequence all-gather) and alias the weights.
    Backward: start the collective, compute the pending weight gradients, wait."""

    @staticmethod
    def forward(ctx, x, group, sequence_parallel, pending, *weights):
        ctx.group, ctx.sequence_parallel, ctx.pending = group, sequence_parallel, pending
        ctx.set_materialize_grads(False)
        entered = all_gather(x, SEQ_DIM, group) if sequence_parallel else x.view_as(x)
        return (entered, *(w.view_as(w) for w in weights))

    @staticmethod
    def backward(ctx, grad, *_alias_grads):
        work, grad_input = None, None
        if grad is not None and ctx.needs_input_grad[0]:
            if ctx.sequence_parallel:
                grad_input, work = start_reduce_scatter(grad, SEQ_DIM, ctx.group)
            else:
                grad_input, work = start_all_reduce(grad, ctx.group)
        weight_grads = ctx.pending.take()  # runs while the collective is in flight
        if work is not None:
            work.wait()
        return (grad_input, None, None, None, *weight_grads)


class _LinearWithPendingWeightGrad(torch.autograd.Function):
    """F.linear whose backward leaves the weight gradient to the entry op that aliased the weight."""

    @staticmethod
    def forward(ctx, x, weight, bias, pending, index):
        ctx.save_for_backward(x, weight)
        ctx.pending, ctx.index = pending, index
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        ctx.pending.add(ctx.index, grad, x)
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
        return grad @ weight, None, grad_bias, None, None


@dataclass
class _Entry:
    source: weakref.ref
    version: int
    group: ProcessGroup
    sequence_parallel: bool
    entered: torch.Tensor
    pending: _PendingWeightGrads | None = None
    aliases: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=dict)  # id -> w, alias, i

    def matches(self, x: torch.Tensor, group: ProcessGroup, sequence_parallel: bool) -> bool:
        return (
            self.source() is x
            and x._version == self.version
            and self.group is group
            and self.sequence_parallel == sequence_parallel
        )


def _overlappable(layer) -> bool:
    weight = getattr(layer, "weight", None)
    return (
        layer.wiring.overlap
        and getattr(layer, "defers_weight_grads", False)
        and weight is not None
        and weight.requires_grad
        and getattr(layer, "replica_group", None) is None
    )


def _traced_entry(x: torch.Tensor, group: ProcessGroup, sequence_parallel: bool) -> torch.Tensor:
    """The entry as torch.compile traces it: one op per layer, no cache, no overlap. The compile backend folds the
    entries of one tensor into one (`compiled.merge_entries`); the weight gradients are the compiled backward's."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x, group, dim=SEQ_DIM)
    return copy_to_tensor_parallel_region(x, group)


class RegionEntry:
    """Enter the tp region once per input tensor (the last entry is held until the next one: a view of an
    activation that is alive anyway, plus weight aliases). One per model: on XLA, where one process may run several
    ranks (one thread each), each rank builds its own model and so its own entry."""

    def __init__(self) -> None:
        self._last: _Entry | None = None

    def __call__(self, x: torch.Tensor, group: ProcessGroup, sequence_parallel: bool) -> torch.Tensor:
        """The entered input for a layer that computes its own output (no overlap)."""
        if not sequence_parallel and not torch.is_grad_enabled():
            return x
        if torch.compiler.is_compiling():
            return _traced_entry(x, group, sequence_parallel)
        entry = self._entry(x, group, sequence_parallel, layer=None)
        return entry.entered

    def linear(self, layer, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`F.linear(entered x, weight, bias)` for a column-parallel `layer`, overlapped where it can be."""
        sequence_parallel = layer.wiring.splits_sequence()
        if not sequence_parallel and not torch.is_grad_enabled():  # inference: entering is the identity
            return F.linear(x, weight, bias)
        if torch.compiler.is_compiling():
            return F.linear(_traced_entry(x, layer.group, sequence_parallel), weight, bias)
        entry = self._entry(x, layer.group, sequence_parallel, layer)
        alias = entry.aliases.get(id(layer))
        if alias is not None and alias[0] is weight:
            return _LinearWithPendingWeightGrad.apply(entry.entered, alias[1], bias, entry.pending, alias[2])
        return F.linear(entry.entered, weight, bias)

    def remember(self, x: torch.Tensor, group: ProcessGroup, sequence_parallel: bool, entered: torch.Tensor) -> None:
        """Record that `x` entered the region as `entered` through a collective made elsewhere (e.g. one that
        carried LoRA activations along): layers reading `x` next reuse it instead of entering again."""
        if entered.requires_grad:
            self._last = _Entry(weakref.ref(x), x._version, group, sequence_parallel, entered)

    def _entry(self, x: torch.Tensor, group: ProcessGroup, sequence_parallel: bool, layer) -> _Entry:
        last = self._last
        if last is not None and last.matches(x, group, sequence_parallel):
            return last
        entry = self._new_entry(x, group, sequence_parallel, layer)
        self._last = entry if entry.entered.requires_grad else None
        return entry

    def _new_entry(self, x: torch.Tensor, group: ProcessGroup, sequence_parallel: bool, layer) -> _Entry:
        layers = []
        if layer is not None and torch.is_grad_enabled() and not torch.is_autocast_enabled(x.device.type):
            siblings = layer.wiring.siblings.layers if layer.wiring.siblings is not None else ()
            layers = [m for m in [layer, *(s for s in siblings if s is not layer)] if _overlappable(m)]
        if not layers:
            if sequence_parallel:
                entered = gather_from_sequence_parallel_region(x, group, dim=SEQ_DIM)
            else:
                entered = copy_to_tensor_parallel_region(x, group)
            return _Entry(weakref.ref(x), x._version, group, sequence_parallel, entered)
        weights = [m.weight for m in layers]
        pending = _PendingWeightGrads(len(weights))
        entered, *aliases = _OverlappedEntry.apply(x, group, sequence_parallel, pending, *weights)
        return _Entry(
            weakref.ref(x),
            x._version,
            group,
            sequence_parallel,
            entered,
            pending,
            {id(m): (w, a, i) for i, (m, w, a) in enumerate(zip(layers, weights, aliases, strict=True))},
        )


class SequenceRegion:
    """The sequence-parallel region of one model over the tp `group`: whether the running forward splits it."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self.split = True  # the running forward's decision (taken at `enter`)
        self._whole = 0  # callers asking for whole sequences (nested forwards)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The region's entry: this rank's slice of the sequence when this forward can split it, else `x`."""
        self.split = self.splits(x.shape[SEQ_DIM])
        return scatter_to_sequence_parallel_region(x, self.group, dim=SEQ_DIM) if self.split else x

    def splits(self, length: int) -> bool:
        """Whether a forward entering the region now with `length` tokens splits it (what `enter` will decide: work
        added to the hidden states inside the region, image features at their positions, is cut the same way)."""
        return not self._whole and length % ranks.world_size(self.group) == 0

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The whole sequence for work outside the region (this rank's slice of the gradient backward); `x` itself
        in a forward that did not split."""
        return gather_from_tensor_parallel_region(x, self.group, dim=SEQ_DIM) if self.split else x

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Back into the region after replicated work (all-gather of the gradient backward)."""
        return scatter_to_sequence_parallel_region(x, self.group, dim=SEQ_DIM) if self.split else x

    def keep_whole(self) -> None:
        """Until the matching `release`, forwards leave the sequence whole (nests)."""
        self._whole += 1

    def release(self) -> None:
        self._whole -= 1


class Siblings:
    """The column layers of one parent module (q/k/v, gate/up), which may read the same input: one entry serves
    them all and aliases their weights. Each layer adds itself when it is built."""

    def __init__(self) -> None:
        self.layers: list[nn.Module] = []


@dataclass(frozen=True)
class LayerWiring:
    """What the plan decided for one layer (docs/module_notes.md); the default, for a layer built on its own
    outside a plan: its own entry, no sequence parallelism."""

    entry: RegionEntry | None = field(default_factory=RegionEntry)  # None: the caller entered the region
    sequence: SequenceRegion | None = None  # set: the layer is inside a sequence-parallel region
    siblings: Siblings | None = None
    overlap: bool = True

    def splits_sequence(self) -> bool:
        """Whether the running forward splits this layer's sequence (a decode step keeps it whole)."""
        return self.sequence is not None and self.sequence.split
