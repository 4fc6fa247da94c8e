"""Which tokens a cp rank holds: causal load balancing over 2 cp chunks (rank i holds chunks i and 2cp-1-i, as
Megatron and torchtitan do), so every rank attends to the same number of (query, key) pairs under a causal mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class ChunkLayout:
    cp: int
    rank: int
    length: int  # the whole sequence, padded to a multiple of 2 cp

    @classmethod
    def for_sequence(cls, length: int, cp: int, rank: int) -> ChunkLayout:
        parts = 2 * cp
        return cls(cp, rank, -(-length // parts) * parts)

    @property
    def chunk(self) -> int:
        return self.length // (2 * self.cp)

    def chunks_of(self, rank: int) -> tuple[int, int]:
        return rank, 2 * self.cp - 1 - rank

    @property
    def mine(self) -> tuple[int, int]:
        return self.chunks_of(self.rank)

    def take(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a whole (padded) sequence along `dim`."""
        return torch.cat([x.narrow(dim, i * self.chunk, self.chunk) for i in self.mine], dim=dim)

    def positions(self, device=None) -> torch.Tensor:
        """The sequence indices of this rank's tokens."""
        return torch.cat([torch.arange(i * self.chunk, (i + 1) * self.chunk, device=device) for i in self.mine])

    def gather(self, x: torch.Tensor, group: ProcessGroup, dim: int = 1) -> torch.Tensor:
        """The whole sequence, in order, from every rank's tokens (a collective; no gradient)."""
        pieces = [torch.empty_like(x) for _ in range(self.cp)]
        dist.all_gather(pieces, x.contiguous(), group=group)
        chunks: dict[int, torch.Tensor] = {}
        for rank, piece in enumerate(pieces):
            first, second = self.chunks_of(rank)
            chunks[first], chunks[second] = piece.split(self.chunk, dim=dim)
        return torch.cat([chunks[i] for i in range(2 * self.cp)], dim=dim)


@dataclass(frozen=True)
class SequenceCut:
    """How the input split cut one forward's sequence: its length before padding and the layout of the ranks' tokens
    (`ChunkLayout`, or a packed batch's `packed.PackedLayout`)."""

    length: int
    layout: object


def pad_sequence(x: torch.Tensor, length: int, value, dim: int = 1) -> torch.Tensor:
    """`x` padded with `value` at the end of `dim` up to `length`."""
    missing = length - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_full(shape, value)], dim=dim)
