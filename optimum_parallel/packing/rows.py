"""A packed batch's documents laid out in a given number of rows: a pipeline splits a batch into micro-batches along
its rows, and a padding-free batch (TRL's `padding_free`, `DataCollatorWithFlattening`) is one row."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .documents import IGNORE_INDEX, segment_ids

ROW_MULTIPLE = 16  # rows are padded to a multiple of this: fewer distinct shapes for the pipeline's stages


@dataclass(frozen=True)
class Relaid:
    """The new rows (`input_ids`, `labels`, `positions`) and, for every new token, the flat index it came from in
    the old batch (-1 for padding added at the end of a row): `restore` puts per-token values back in place."""

    input_ids: torch.Tensor
    labels: torch.Tensor | None
    positions: torch.Tensor
    source: torch.Tensor
    shape: tuple[int, int]

    def restore(self, values: torch.Tensor) -> torch.Tensor:
        """(new rows, new seq, ...) per-token values -> (old rows, old seq, ...)."""
        flat = values.reshape(-1, *values.shape[2:])
        keep = self.source.reshape(-1) >= 0
        out = flat.new_zeros((self.shape[0] * self.shape[1], *values.shape[2:]))
        out[self.source.reshape(-1)[keep]] = flat[keep]
        return out.view(*self.shape, *values.shape[2:])


def relay_rows(input_ids: torch.Tensor, labels: torch.Tensor | None, positions: torch.Tensor, rows: int) -> Relaid:
    """Lay the documents (segments of the packed `positions`) of every row, in order, into `rows` rows of about the
    same number of tokens, cutting only between documents; rows are padded at the end (ignored labels, each padding
    token a segment of its own)."""
    old_rows, length = input_ids.shape
    segments = segment_ids(positions)
    pieces = []  # (flat start, size) of every document, in order
    for row in range(old_rows):
        ids = segments[row].tolist()
        begin = 0
        for index in range(1, length + 1):
            if index == length or ids[index] != ids[begin]:
                pieces.append((row * length + begin, index - begin))
                begin = index
    total = sum(size for _, size in pieces)
    groups: list[list[tuple[int, int]]] = [[] for _ in range(rows)]
    done, row = 0, 0
    for start, size in pieces:
        # move to the next row once this one reached its share, keeping the rows left for the documents left
        while row < rows - 1 and groups[row] and done + size / 2 > total * (row + 1) / rows:
            row += 1
        groups[row].append((start, size))
        done += size
    longest = max(sum(size for _, size in group) for group in groups)
    width = -(-max(longest, 1) // ROW_MULTIPLE) * ROW_MULTIPLE
    source = torch.full((rows, width), -1, dtype=torch.long)
    for row, group in enumerate(groups):
        flat = [i for start, size in group for i in range(start, start + size)]
        source[row, : len(flat)] = torch.tensor(flat, dtype=torch.long)
    source = source.to(input_ids.device)
    taken = source.clamp(min=0)
    pad = source < 0
    new_ids = input_ids.reshape(-1)[taken].masked_fill(pad, 0)
    new_positions = positions.reshape(-1)[taken].masked_fill(pad, 0)  # 0 never continues a real position
    new_labels = None if labels is None else labels.reshape(-1)[taken].masked_fill(pad, IGNORE_INDEX)
    return Relaid(new_ids, new_labels, new_positions, source, (old_rows, length))
