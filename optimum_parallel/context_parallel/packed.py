"""Context parallelism over packed rows: the row cut into equal chunks dealt to the cp ranks by attention work
(`chunk_count`, `chunk_work`, `deal`, `PackedLayout`), and which chunk pairs see each other through the documents
(`Documents`, made by `documents_for`). Design notes: docs/module_notes.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

CHUNKS_PER_RANK = 8


def chunk_count(length: int, cp: int, per_rank: int = CHUNKS_PER_RANK) -> tuple[int, int]:
    """(chunks, padded length): k cp chunks for the k <= `per_rank` that pads the least (the largest k among those)."""
    best = None
    for k in range(per_rank, 0, -1):
        count = k * cp
        padded = -(-max(length, 1) // count) * count
        if best is None or padded < best[1]:
            best = (count, padded)
    return best


@dataclass(frozen=True)
class PackedLayout:
    """Which chunks of a (padded) packed row every cp rank holds, in the order it holds them (as `ChunkLayout`,
    with any number of chunks per rank)."""

    cp: int
    rank: int
    length: int  # the whole row, padded to a multiple of the chunk count
    owned: tuple[tuple[int, ...], ...]  # per rank, its chunk ids in ascending order

    @property
    def chunk(self) -> int:
        return self.length // sum(len(chunks) for chunks in self.owned)

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        return self.owned[rank]

    @property
    def mine(self) -> tuple[int, ...]:
        return self.owned[self.rank]

    def take(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a whole (padded) row along `dim`."""
        return torch.cat([x.narrow(dim, i * self.chunk, self.chunk) for i in self.mine], dim=dim)

    def gather(self, x: torch.Tensor, group: ProcessGroup, dim: int = 1) -> torch.Tensor:
        """The whole row, in order, from every rank's tokens (a collective; no gradient)."""
        pieces = [torch.empty_like(x) for _ in range(self.cp)]
        dist.all_gather(pieces, x.contiguous(), group=group)
        chunks: dict[int, torch.Tensor] = {}
        for rank, piece in enumerate(pieces):
            for index, part in zip(self.owned[rank], piece.split(self.chunk, dim=dim), strict=True):
                chunks[index] = part
        return torch.cat([chunks[i] for i in range(len(chunks))], dim=dim)


def chunk_work(segments: torch.Tensor, chunks: int, window: int | None = None, real: torch.Tensor | None = None):
    """Per chunk, the (query, key) pairs its queries attend to over every row: for each query the keys of its own
    document up to it (at most `window` of them), for real queries only (`real`: (batch, seq) bool or None)."""
    rows, length = segments.shape
    index = torch.arange(length, device=segments.device).expand(rows, length)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=-1).values
    seen = index - first + 1
    if window is not None:
        seen = seen.clamp(max=window)
    if real is not None:
        seen = seen * real.to(seen.device)
    return seen.sum(0).view(chunks, length // chunks).sum(-1).tolist()


def deal(work: list[int], cp: int) -> tuple[tuple[int, ...], ...]:
    """`len(work)` chunks to `cp` ranks, the same number each: heaviest first, each to the least loaded rank that is
    not yet full."""
    per_rank = len(work) // cp
    load, owned = [0] * cp, [[] for _ in range(cp)]
    for chunk in sorted(range(len(work)), key=lambda j: (-work[j], j)):
        rank = min((r for r in range(cp) if len(owned[r]) < per_rank), key=lambda r: (load[r], r))
        owned[rank].append(chunk)
        load[rank] += work[chunk]
    return tuple(tuple(sorted(chunks)) for chunks in owned)


@dataclass(frozen=True)
class Documents:
    """What the attention needs of a packed row under cp: the layout and, per chunk and row, the segment of its first
    and last token (pairs of chunks are classified from these, on the host, once per forward), and the segment of
    every token (for the masks)."""

    layout: PackedLayout
    segments: torch.Tensor  # (batch, length)
    first: tuple[tuple[int, ...], ...]  # [row][chunk]
    last: tuple[tuple[int, ...], ...]
    positions: torch.Tensor | None = None  # (batch, length): the position ids, for attention chunks (`span_ids`)

    def visibility(self, q_chunk: int, k_chunk: int) -> str:
        """'none' when no query of `q_chunk` shares a document with a key of `k_chunk` (before it), 'inside' when
        every row's both chunks lie in one document, else 'mixed'."""
        if k_chunk > q_chunk:
            return "none"
        first, last = self.first, self.last
        if k_chunk < q_chunk and not any(last[row][k_chunk] == first[row][q_chunk] for row in range(len(first))):
            return "none"  # (a chunk always sees itself: every query its own key)
        if all(first[row][k_chunk] == last[row][q_chunk] for row in range(len(first))):
            return "inside"
        return "mixed"

    def span_ids(self, size: int) -> torch.Tensor:
        """(batch, length): every token's attention chunk of `size` positions inside its document (transformers counts
        a packed row's chunks on its position ids), as ids non-decreasing along the row."""
        if self.positions is None:
            raise ValueError("these documents were built without their position ids; pass positions to documents_for")
        spans = torch.div(self.positions, size, rounding_mode="floor")
        low = spans.min()
        return self.segments * (spans.max() - low + 1) + (spans - low)

    def same_document(self, q_chunk: int, k_chunk: int) -> torch.Tensor:
        """(batch, 1, chunk, chunk) bool: query and key in one document."""
        c = self.layout.chunk
        q = self.segments[:, q_chunk * c : (q_chunk + 1) * c]
        k = self.segments[:, k_chunk * c : (k_chunk + 1) * c]
        return (q[:, :, None] == k[:, None, :])[:, None]


def documents_for(
    segments: torch.Tensor,
    cp: int,
    rank: int,
    window: int | None = None,
    real: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> Documents:
    """The layout of a packed (already padded) batch with `segments` (batch, length) over `cp` ranks, seen from
    `rank`; `length` must be a multiple of `chunk_count(length, cp)[0]`. `positions`: the rows' position ids (for
    chunked attention)."""
    chunks, padded = chunk_count(segments.shape[1], cp)
    if padded != segments.shape[1]:
        raise ValueError(f"a packed row of {segments.shape[1]} tokens under cp={cp} must be padded to {padded} first")
    layout = PackedLayout(cp, rank, padded, deal(chunk_work(segments, chunks, window, real), cp))
    c = layout.chunk
    host = segments.cpu()
    first = tuple(tuple(row) for row in host[:, ::c].tolist())
    last = tuple(tuple(row) for row in host[:, c - 1 :: c].tolist())
    return Documents(layout, segments, first, last, positions)
