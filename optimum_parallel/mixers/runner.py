"""The forward every token mixer that carries a state runs on a parallel model: one device's answer on the whole
sequence, whatever the layout. `install_mixers` routes each mixer's forward through `run_mixer`, which takes the
running forward's `SequenceMarker` (marker.py) as its `attention_mask`: the whole sequence under cp, each document
alone over packed rows, else the padding mask; without a marker the mixer runs as transformers wrote it.
"""

from __future__ import annotations

import functools
import inspect
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..comm.autograd_collectives import gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region
from ..mesh import ranks
from .document_batches import buckets, run_documents
from .heads import sliced_class, split_heads
from .marker import SequenceMarker, current_marker, install_markers
from .plan import MixerSpec

_KEY = "_optimum_parallel_mixer"


@dataclass(frozen=True)
class MixerRun:
    """What a mixer's forward needs: its name (for errors), whether its heads are split over cp, the cp group."""

    name: str
    heads: bool
    group: ProcessGroup | None


@functools.cache
def _signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.forward)


def _rank_order(marker: SequenceMarker, device) -> torch.Tensor:
    """The whole sequence's indices in the order the ranks' tokens are gathered (rank 0's, then rank 1's, ...)."""

    def make():
        layout = marker.layout
        chunk, cp = layout.chunk, layout.cp
        pieces = [torch.arange(i * chunk, (i + 1) * chunk) for r in range(cp) for i in layout.chunks_of(r)]
        return torch.cat(pieces).to(device)

    return marker.cached("order", make)


def gather_whole(x: torch.Tensor, marker: SequenceMarker, group: ProcessGroup) -> torch.Tensor:
    """The whole (padded) sequence in order from every cp rank's tokens; backward, each rank's tokens' gradient
    summed over the ranks."""
    order = _rank_order(marker, x.device)
    inverse = marker.cached("inverse", lambda: torch.argsort(order))
    return gather_from_sequence_parallel_region(x, group, dim=1).index_select(1, inverse)


def scatter_mine(y: torch.Tensor, marker: SequenceMarker, run: MixerRun) -> torch.Tensor:
    """This rank's tokens of the whole sequence's output: the cp ranks' partial sums over their heads added up, or
    (a mixer run whole) this rank's tokens taken."""
    if not run.heads:
        return marker.layout.take(y)
    order = _rank_order(marker, y.device)
    return reduce_scatter_to_sequence_parallel_region(y.index_select(1, order), run.group, dim=1)


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _with_first(output, value):
    return (value, *output[1:]) if isinstance(output, tuple) else value


def run_mixer(cls: type, self: nn.Module, *args, **kwargs):
    """`cls.forward` (the mixer's own) on the sequence the marker describes (see `docs/module_notes.md`)."""
    run: MixerRun = self.__dict__[_KEY]
    bound = _signature(cls).bind(self, *args, **kwargs)
    arguments = bound.arguments
    marker = arguments.get("attention_mask")
    if not isinstance(marker, SequenceMarker):
        if run.group is not None or current_marker() is not None:
            raise RuntimeError(
                f"{run.name} ({cls.__name__}) got no sequence marker in a forward over packed rows or under context "
                "parallelism: its decoder does not build the mixers' mask with transformers' "
                "create_recurrent_attention_mask, so its state cannot be kept to each document or cross the cp ranks"
            )
        return cls.forward(self, *args, **kwargs)
    x = arguments["hidden_states"]
    if marker.layout is not None:
        x = gather_whole(x, marker, run.group)

    def call(inputs: torch.Tensor, mask):
        arguments["hidden_states"], arguments["attention_mask"] = inputs, mask
        return cls.forward(*bound.args, **bound.kwargs)

    if marker.segments is not None:
        parts = marker.cached("buckets", lambda: buckets(marker.segments))
        outputs = []

        def alone(batch: torch.Tensor) -> torch.Tensor:  # documents of one length, no padding mask: each alone
            outputs.append(call(batch, None))
            return _first(outputs[-1])

        y = run_documents(alone, x, parts)
        output = _with_first(outputs[-1], y)
    else:
        real = marker.real
        output = call(x, None if real is None else real.to(torch.long))
        y = _first(output)
    if marker.layout is not None:
        y = scatter_mine(y, marker, run)
    return _with_first(output, y)


def _runner_forward(cls: type):
    def forward(self, *args, **kwargs):
        return run_mixer(cls, self, *args, **kwargs)

    return forward


def decoder_of(model: nn.Module, mixer: str) -> nn.Module:
    """The module owning the layer list `mixer` sits in (`model.layers.3.linear_attn` -> `model`): the decoder whose
    forward builds its layers' masks."""
    match = re.match(r"(.*?)\.?[^.]+\.\d+\.", mixer + ".")
    owner = match.group(1) if match else ""
    return model.get_submodule(owner) if owner else model


def install_mixers(
    model: nn.Module,
    specs: Sequence[MixerSpec],
    tp: tuple[int, int] = (0, 1),
    cp_group: ProcessGroup | None = None,
    layout_rank: int | None = None,
) -> None:
    """Run every mixer of `specs` through `run_mixer` (once per model), its heads split over cp where its spec says,
    and mark the forwards of the decoders they sit in (marker.py). `tp`: (rank, size); `cp_group`: None without cp;
    `layout_rank`: this rank's place in the cp layout."""
    cp = ranks.world_size(cp_group) if cp_group is not None else 1
    cp_rank = ranks.rank(cp_group) if cp_group is not None else 0
    decoders = {}
    for spec in specs:
        mixer = model.get_submodule(spec.name)
        if _KEY in mixer.__dict__:
            continue
        heads = cp > 1 and spec.mode == "heads"
        sliced = split_heads(mixer, spec, tp, (cp_rank, cp), cp_group) if heads else {}
        if cp > 1 and not heads:
            warnings.warn(
                f"{spec.name} ({type(mixer).__name__}) runs whole on every one of the {cp} context-parallel ranks: "
                f"{spec.reason}",
                stacklevel=2,
            )
        for module, names in sliced.items():
            if module is not mixer:
                module.__class__ = sliced_class(type(module), names)
        cls = type(mixer)
        mixer.__class__ = sliced_class(cls, sliced.get(mixer, ()), {"forward": _runner_forward(cls)})
        mixer.__dict__[_KEY] = MixerRun(spec.name, heads, cp_group if cp > 1 else None)
        decoder = decoder_of(model, spec.name)
        decoders[id(decoder)] = decoder
    for decoder in decoders.values():
        install_markers(decoder, cp if cp > 1 else None, layout_rank)
