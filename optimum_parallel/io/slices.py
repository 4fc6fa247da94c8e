"""Reading one rank's slice of a tensor in a safetensors file: mapped where contiguous, pread otherwise."""

from __future__ import annotations

import torch

from ..tensor_parallel.spec import ShardLayout
from .file_mapping import can_map
from .safetensors_io import SafetensorsReader


def read_slice(
    reader: SafetensorsReader,
    key: str,
    layout: ShardLayout | None,
    scratch: torch.Tensor | None = None,
    experts: tuple[int, int] | None = None,
) -> torch.Tensor:
    """This rank's slice of tensor `key` of a safetensors file (all of it when `layout` is None); `experts`: only
    that block of dim 0 (the experts an expert-parallel rank holds), within which `layout` (a cut along another
    dim) applies. The other experts' bytes are never read.

    Where the slice is one run of bytes on disk (a replicated weight, the rows of a dim-0 split, a block of experts)
    it is, as in transformers' own loading, a copy-on-write mapping of the file: nothing is copied at load, a page
    is read when first touched, writing a weight copies its page and never the file. Unlike `safe_open`, only the
    slice's own bytes are mapped (`file_mapping`). Any other slice is read with pread into its own memory
    (through `scratch`, see `SafetensorsReader.read_slice`).
    Our own saves write new files and rename them, so they never change the bytes under a loaded model;
    rewriting the HF files in place while the model lives would.
    """
    _, shape = reader.info(key)
    if layout is not None and shape != tuple(layout.global_shape):
        raise ValueError(f"{reader.path}: {key} has shape {list(shape)}, the model expects {list(layout.global_shape)}")
    if experts is not None and layout is not None and layout.dim is not None:
        return reader.read_slice(key, layout.dim, layout.ranges, scratch, rows=experts)
    if experts is not None:
        layout = ShardLayout(shape, 0, (experts,))
    if layout is None or (layout.dim == 0 and len(layout.ranges) == 1):
        if not can_map():
            return reader.read(key) if layout is None else reader.read_slice(key, 0, layout.ranges, scratch)
        start, stop = layout.ranges[0] if layout is not None else (0, shape[0] if shape else 0)
        return reader.map_rows(key, start, stop)
    return reader.read_slice(key, layout.dim, layout.ranges, scratch)
