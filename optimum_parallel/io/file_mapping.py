"""Tensors that are private copy-on-write mappings of exactly their own bytes of a file.

Lazy loading hands each rank views of the checkpoint instead of copies (as transformers' loading does):
nothing is read until a page is touched, and writing a weight copies its page, never the file. One mapping
per tensor rather than one per file, because the kernel maps a whole page-cache folio (up to 2 MiB here) on a
fault: with one file-wide mapping the neighbouring tensors' bytes -- the other ranks' parts -- end up in this
rank's resident memory (measured +18% of the shard, scripts/bench_load.py). Raw `mmap(2)` through ctypes,
because Python's `mmap.mmap` keeps a duplicate file descriptor open per mapping (hundreds for a large model).
"""

from __future__ import annotations

import ctypes
import mmap
import weakref

import torch

from ..mesh import device as devices
from .libc import libc

_PAGE = mmap.PAGESIZE
_MAP_FAILED = ctypes.c_void_p(-1).value


def can_map() -> bool:
    return libc is not None


def map_bytes(fd: int, start: int, end: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Bytes [start, end) of the file open as `fd`, as a tensor of `shape` and `dtype` that maps them privately
    (copy-on-write). The mapping lives as long as the tensor's storage; `fd` may be closed right away."""
    if libc is None:
        raise OSError("file mappings need Linux")
    offset = start // _PAGE * _PAGE
    length = end - offset
    address = libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, offset)
    if address in (None, _MAP_FAILED):
        errno = ctypes.get_errno()
        raise OSError(errno, f"mmap of {length} bytes at offset {offset} failed")
    buffer = (ctypes.c_char * length).from_address(address)
    _MAPPED.add(address)
    unmap = weakref.finalize(buffer, _unmap, address, length)  # when the last tensor on it is freed
    unmap.atexit = False  # never at interpreter exit, while tensors may still use it: the OS unmaps then
    count = (end - start) // dtype.itemsize
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=start - offset).view(shape)


_MAPPED: set[int] = set()  # addresses of the live mappings


def _unmap(address: int, length: int) -> None:
    _MAPPED.discard(address)
    libc.munmap(address, length)


def is_file_mapping(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s memory is one of `map_bytes`' file mappings (a lazily loaded weight): loading other
    values into it is better done by mapping them than by writing each page, which copies it first."""
    if not devices.is_host(tensor) or tensor.untyped_storage().nbytes() == 0:
        return False
    return tensor.untyped_storage().data_ptr() // _PAGE * _PAGE in _MAPPED
