"""How a tensor-parallel layer meets its neighbours, decided once with the plan and passed to its constructor.

A column layer enters the tp region (identity forward / all-reduce backward, or the sequence all-gather /
reduce-scatter inside a sequence-parallel region) unless its caller already did (`entry` None: a block that gathered
the whole sequence at its boundary); the layers reading the same input share one entry (`siblings`, the column
layers of one parent module), and their weight gradients are computed while its backward collective runs
(`overlap`, off under pipeline schedules that defer weight gradients themselves). A row layer (and the vocab-parallel
embedding) leaves the region with an all-reduce, or a reduce-scatter of the sequence inside a sequence-parallel
region (`sequence`). Nothing changes a mode after the layer is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn
from torch.distributed import ProcessGroup

from ..comm.region_entry import RegionEntry
from ..comm.sequence_region import SequenceRegion


class Siblings:
    """The column layers of one parent module (q/k/v, gate/up), which may read the same input: one entry serves
    them all and aliases their weights. Each layer adds itself when it is built."""

    def __init__(self) -> None:
        self.layers: list[nn.Module] = []


@dataclass(frozen=True)
class LayerMode:
    """What the plan decided for one layer (see the module docstring)."""

    entry: RegionEntry | None = field(default_factory=RegionEntry)  # None: the caller entered the region
    sequence: SequenceRegion | None = None  # set: the layer is inside a sequence-parallel region
    siblings: Siblings | None = None
    overlap: bool = True

    def splits_sequence(self) -> bool:
        """Whether the running forward splits this layer's sequence (a decode step keeps it whole)."""
        return self.sequence is not None and self.sequence.split


def plain_mode(group: ProcessGroup | None = None) -> LayerMode:
    """The mode of a layer built on its own (outside a plan): its own entry, no sequence parallelism."""
    return LayerMode()
