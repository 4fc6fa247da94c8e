"""`populated_empty`: the tensor a slice read copies into, with its pages faulted in by one call."""

from __future__ import annotations

import ctypes
import mmap
import sys
from contextlib import contextmanager

import pytest
import torch

from optimum_parallel.io import fresh_memory


def _resident_pages(tensor: torch.Tensor) -> tuple[int, int]:
    """(resident, total) pages under `tensor`'s bytes, by mincore(2)."""
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    length = tensor.data_ptr() + tensor.untyped_storage().nbytes() - start
    pages = -(-length // page)
    flags = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), flags) == 0, ctypes.get_errno()
    return sum(f & 1 for f in flags), pages


@contextmanager
def _torch_threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_POPULATE_WRITE) is Linux's")
def test_pages_are_resident_before_the_first_write():
    if not fresh_memory._supported:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    with _torch_threads(1):
        out = fresh_memory.populated_empty((4 << 20,), torch.float32)  # 16 MiB, never written
    resident, pages = _resident_pages(out)
    assert resident == pages
    out.fill_(1.5)
    assert out.shape == (4 << 20,) and out.dtype == torch.float32 and out.sum().item() == 1.5 * (4 << 20)


def test_without_the_kernel_call_it_is_torch_empty(monkeypatch):
    monkeypatch.setattr(fresh_memory, "_supported", False)
    out = fresh_memory.populated_empty((3, 1 << 20), torch.bfloat16)
    assert out.shape == (3, 1 << 20) and out.dtype == torch.bfloat16 and out.is_contiguous()


def test_on_several_threads_the_copy_faults_the_pages_in_parallel_instead():
    with _torch_threads(2):  # 64 MiB: above glibc's largest mmap threshold, so a fresh mapping (never memory an
        out = fresh_memory.populated_empty((16 << 20,), torch.float32)  # earlier test freed and left resident)
    resident, pages = _resident_pages(out)
    assert resident < pages
