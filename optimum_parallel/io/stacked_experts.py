"""Reading a rank's slice of a stacked experts tensor from a checkpoint that stores one tensor per expert.

transformers saves mixtral / qwen2_moe / qwen3_moe experts as `experts.<e>.w1` (`gate_proj`), `w3` (`up_proj`) and
`w2` (`down_proj`), and builds `experts.gate_up_proj` [E, 2I, H] (its `MergeModulelist(dim=0)` then
`Concatenate(dim=1)`) and `experts.down_proj` [E, H, I] at load. Here the same tensor is assembled for one rank only:
the rank's experts (`experts`), and within each of them its cut of the other dims (`layout`), reading from each
per-expert tensor nothing but the rows the cut needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..tensor_parallel.spec import ShardLayout
from .safetensors_io import SafetensorsReader


@dataclass(frozen=True)
class StackedExpertsSource:
    """Where the experts of one stacked tensor live: `parts[p][e]` = (file, key) of part p (gate, up) of expert e;
    the parts are concatenated along dim 1 of the stacked tensor (dim 0 of each per-expert tensor)."""

    parts: tuple[tuple[tuple[str, str], ...], ...]
    part_rows: tuple[int, ...]  # dim 0 of each part's per-expert tensor

    @property
    def num_experts(self) -> int:
        return len(self.parts[0])

    def files(self) -> set[str]:
        return {file for part in self.parts for file, _ in part}


def _pieces(source: StackedExpertsSource, ranges) -> list[tuple[int, int, int]]:
    """(part, first row, last row) pieces of the concatenated dim covering `ranges`, in order."""
    pieces, offsets = [], [sum(source.part_rows[:p]) for p in range(len(source.part_rows))]
    for start, end in ranges:
        for part, (offset, rows) in enumerate(zip(offsets, source.part_rows, strict=True)):
            lo, hi = max(start, offset), min(end, offset + rows)
            if lo < hi:
                pieces.append((part, lo - offset, hi - offset))
    return pieces


def read_stacked_experts(
    source: StackedExpertsSource,
    reader: Callable[[str], SafetensorsReader],
    layout: ShardLayout | None,
    experts: tuple[int, int] | None,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's [experts, ...] block of the stacked tensor, cut by `layout` (dim 1: the concatenated dim, e.g.
    tp's gate and up slices; dim >= 2: a dim of every per-expert tensor); `reader(file)` opens a file once."""
    first, last = experts if experts is not None else (0, source.num_experts)
    if layout is not None and layout.dim == 0:
        raise ValueError("a stacked experts tensor is cut along the experts only through the expert range")
    out: torch.Tensor | None = None
    for expert in range(first, last):
        if layout is not None and layout.dim == 1:
            chunks = [
                reader(source.parts[part][expert][0]).read_slice(source.parts[part][expert][1], 0, [(lo, hi)], scratch)
                for part, lo, hi in _pieces(source, layout.ranges)
            ]
        else:
            chunks = []
            for part in source.parts:
                file, key = part[expert]
                if layout is None:
                    chunks.append(reader(file).read(key))
                else:
                    chunks.append(reader(file).read_slice(key, layout.dim - 1, layout.ranges, scratch))
        if out is None:  # one block for the rank's experts, filled expert by expert
            shape = (sum(c.shape[0] for c in chunks), *chunks[0].shape[1:])
            out = torch.empty((last - first, *shape), dtype=chunks[0].dtype)
        if len(chunks) == 1:
            out[expert - first].copy_(chunks[0])
        else:
            torch.cat(chunks, dim=0, out=out[expert - first])
    if out is None:
        raise ValueError("no experts to read")
    return out
