"""A sequence-parallel region: the one object, made with the plan, that every layer and hook of the region holds.

A sequence-parallel plan splits the sequence at the region's entry (`enter`). A forward whose sequence length the
tp size does not divide (a one-token decode step), or that keeps only the last positions' logits (`logits_to_keep`,
which `generate` passes; the model's own hooks call `keep_whole` around it), runs the plain tensor-parallel path
instead: the entry leaves the sequence whole and every layer of the region takes its tensor-parallel collective.
Same weights, same results; the decision is taken once per forward, at the region's entry, from shapes every tp rank
shares, so the ranks always agree. The region belongs to one model (on XLA each rank's thread builds its own).
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from ..mesh import ranks
from .regions import SEQ_DIM, gather_from_tensor_parallel_region, scatter_to_sequence_parallel_region


class SequenceRegion:
    """The sequence-parallel region of one model over the tp `group`: whether the running forward splits it."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self.split = True  # the running forward's decision (taken at `enter`)
        self._whole = 0  # callers asking for whole sequences (nested forwards)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The region's entry: this rank's slice of the sequence when this forward can split it, else `x`."""
        tp = ranks.world_size(self.group)
        self.split = not self._whole and x.shape[SEQ_DIM] % tp == 0
        return scatter_to_sequence_parallel_region(x, self.group, dim=SEQ_DIM) if self.split else x

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
