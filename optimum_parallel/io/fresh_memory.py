"""New tensors whose pages are faulted in at once, for the bytes a load is about to copy into them.

A fresh allocation's pages fault one at a time as the copy first writes them: one trap per 4 KiB page, which on
a VM was most of the cost of reading a row-parallel slice. `madvise(MADV_POPULATE_WRITE)` (Linux 5.14+) faults
them in one call. Reading the 264 MiB of a 0.49B fp32 model's row-parallel slices at tp=2 (scripts/bench_load.py's
checkpoint, fresh processes, alternating) took a median 0.34 s -> 0.32 s (8 pairs; 0.36 -> 0.31 s in an earlier 6).
It allocates nothing the copy would not write anyway. (Transparent huge pages on top were slower here: 0.46-0.62 s.)
Only for a rank on one intra-op thread: madvise faults the pages on the calling thread alone, while torch's copy
into plain `torch.empty` faults them on all its threads at once (two threads: 0.20-0.22 s without it, 0.24-0.31 s
with it).
"""

from __future__ import annotations

import mmap

import torch

from .libc import libc

_PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23
_WORTH_IT = 1 << 20  # below this, the faults cost less than noticing them
_supported = libc is not None


def populated_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`torch.empty(shape, dtype=dtype)` on the CPU, its pages already faulted in where the kernel can and torch
    copies on one thread."""
    global _supported
    out = torch.empty(shape, dtype=dtype)
    size = out.untyped_storage().nbytes()
    if _supported and size >= _WORTH_IT and torch.get_num_threads() == 1:
        start = out.data_ptr() // _PAGE * _PAGE  # the pages holding the tensor, all inside its allocation's mapping
        length = -(-(out.data_ptr() + size - start) // _PAGE) * _PAGE
        if libc.madvise(start, length, _MADV_POPULATE_WRITE) != 0:
            _supported = False  # an older kernel (EINVAL): the pages fault on first write, as before
    return out
