"""Packed documents through a mixer that carries a state: every document runs alone, its state starting fresh.

The documents of the whole (batch, seq) rows are cut out and laid in batches of rows of one length, a power of two
(each document padded at its end: the mixers are causal, so padding after a document never reaches it); a bucket is
one call of the mixer, so a batch of many documents costs log2(longest) calls, not one per document, and at most twice
the tokens. The outputs go back to their tokens' places. Made once per forward (the documents' host-side lengths
are read once, on the marker) and shared by every mixer layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Bucket:
    """`index`: (documents, length) flat token indices of the rows' tokens, -1 for the padding after a document."""

    index: torch.Tensor
    valid: torch.Tensor  # index >= 0
    flat_valid: torch.Tensor  # index[valid]: where the bucket's outputs go


def buckets(segments: torch.Tensor) -> list[Bucket]:
    """The documents of `segments` (batch, seq; a new value starts a document) in buckets of rows of one length."""
    rows, length = segments.shape
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = starts.reshape(-1).nonzero().flatten()
    sizes = torch.diff(first, append=torch.tensor([rows * length], device=first.device))
    # a document never crosses a row: a row's first token always starts one (starts[:, 0] is True)
    host_first, host_sizes = first.tolist(), sizes.tolist()
    by_width: dict[int, list[tuple[int, int]]] = {}
    for start, size in zip(host_first, host_sizes, strict=True):
        width = 1 << (size - 1).bit_length()
        by_width.setdefault(width, []).append((start, size))
    out = []
    for width, documents in sorted(by_width.items()):
        index = torch.full((len(documents), width), -1, dtype=torch.long)
        for row, (start, size) in enumerate(documents):
            index[row, :size] = torch.arange(start, start + size)
        index = index.to(segments.device)
        valid = index >= 0
        out.append(Bucket(index, valid, index[valid]))
    return out


def run_documents(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, parts: list[Bucket]) -> torch.Tensor:
    """`run` (a mixer on (documents, length, hidden)) over every document of `x` (batch, seq, hidden) on its own."""
    rows, length = x.shape[:2]
    flat = x.reshape(rows * length, *x.shape[2:])
    outputs, places = [], []
    for part in parts:
        batch = flat[part.index.clamp(min=0)]
        batch = batch * part.valid.unsqueeze(-1).to(batch.dtype)  # the padding after each document: zeros
        y = run(batch)
        outputs.append(y[part.valid])
        places.append(part.flat_valid)
    values = torch.cat(outputs)
    out = values.new_zeros(rows * length, *values.shape[1:]).index_copy(0, torch.cat(places), values)
    return out.view(rows, length, *values.shape[1:])
