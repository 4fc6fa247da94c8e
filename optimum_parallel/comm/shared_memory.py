"""Collectives through shared memory, for a gloo group whose ranks share one host (CPU tensors).

`SharedMemoryGroup` offers `all_reduce`, `all_gather` and `reduce_scatter` with torch.distributed's signatures, every
rank's result bitwise the same; `shared_memory_group` gives a group's, or None to use torch.distributed (shared memory
is used only on x86-64 Linux; `OPTIMUM_PARALLEL_SHM=0` turns it off).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import secrets
import tempfile
import time
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from ..mesh import device as devices
from ..mesh import ranks

CAPACITY = 4 << 20  # bytes per rank and slot set; larger all-reduces go through in chunks of this size
_CACHE_LINE = 64
_TOKEN_BYTES = 16
_SPINS_BEFORE_YIELD = 2000
_ENV_SWITCH = "OPTIMUM_PARALLEL_SHM"
_SHM_DIR = "/dev/shm"

_REDUCERS: dict[ReduceOp.RedOpType, Callable[..., torch.Tensor]] = {
    ReduceOp.SUM: torch.add,
    ReduceOp.MAX: torch.maximum,
    ReduceOp.MIN: torch.minimum,
}


class _Work:
    """What a started shared-memory collective returns: `wait()` finishes it (like `torch.distributed.Work`)."""

    def __init__(self, finish: Callable[[], None]) -> None:
        self._finish: Callable[[], None] | None = finish

    def wait(self, timeout=None) -> bool:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        return self._finish is None


class SharedMemoryGroup:
    """The shared-memory stand-in for one process group's collectives (protocol: `docs/module_notes.md`)."""

    def __init__(self, mapping: mmap.mmap, rank: int, world: int, timeout_s: float | Callable[[], float]) -> None:
        self.rank, self.world, self._timeout_s = rank, world, timeout_s
        self._mapping = mapping
        self._bytes = torch.frombuffer(mapping, dtype=torch.uint8)
        self._counters = [ctypes.c_int64.from_buffer(mapping, r * _CACHE_LINE) for r in range(world)]
        self._header = _header_bytes(world)
        self._sequence = 0
        self._pending: _Work | None = None

    @property
    def timeout_s(self) -> float:
        """How long a collective waits for the others: the group's timeout now (it changes once training runs, see
        mesh/timeouts.py)."""
        return self._timeout_s() if callable(self._timeout_s) else self._timeout_s

    # -- the torch.distributed-like collectives ------------------------------------------------------------

    def fits(self, tensor: torch.Tensor) -> bool:
        """Whether one slot holds `tensor` (all-gather and reduce-scatter do not chunk)."""
        return tensor.numel() * tensor.element_size() <= CAPACITY

    @staticmethod
    def reduces(op) -> bool:
        """Whether `all_reduce` takes `op` (SUM, MAX, MIN)."""
        return op in _REDUCERS

    def all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM, async_op: bool = False) -> _Work | None:
        """Reduce the contiguous `tensor` in place over the group, in chunks of at most `CAPACITY` bytes."""
        reduce = _REDUCERS[op]
        chunks = tensor.view(-1).split(max(1, CAPACITY // tensor.element_size()))
        first = self._arrive([chunks[0]])

        def finish() -> None:
            for index, chunk in enumerate(chunks):
                sequence = first if index == 0 else self._arrive([chunk])
                slots = self._wait_for_all(sequence, chunk.dtype, chunk.numel())
                _reduce_in_rank_order(reduce, slots, out=chunk)

        return self._started(finish, async_op)

    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, async_op: bool = False):
        """Every rank's `tensor` into `tensor_list` (in rank order)."""
        sequence = self._arrive([tensor])

        def finish() -> None:
            for part, slot in zip(tensor_list, self._wait_for_all(sequence, tensor.dtype, tensor.numel()), strict=True):
                part.copy_(slot.view_as(tensor))

        return self._started(finish, async_op)

    def reduce_scatter(self, output: torch.Tensor, input_list: list[torch.Tensor], async_op: bool = False):
        """The sum over ranks of everyone's `input_list[rank]` into `output` (equal-sized inputs)."""
        sequence = self._arrive(input_list)
        size = output.numel()

        def finish() -> None:
            slots = self._wait_for_all(sequence, output.dtype, size * self.world)
            mine = [slot.narrow(0, self.rank * size, size) for slot in slots]
            _reduce_in_rank_order(torch.add, mine, out=output)

        return self._started(finish, async_op)

    # -- protocol --------------------------------------------------------------------------------------------

    def _started(self, finish: Callable[[], None], async_op: bool) -> _Work | None:
        def run() -> None:
            if self._pending is work:
                self._pending = None
            finish()

        work = _Work(run)
        if not async_op:
            work.wait()
            return None
        self._pending = work
        return work

    def _slot(self, sequence: int, rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        start = self._header + ((sequence % 2) * self.world + rank) * CAPACITY
        return self._bytes.narrow(0, start, numel * dtype.itemsize).view(dtype)

    def _arrive(self, tensors: list[torch.Tensor]) -> int:
        """Write `tensors` (one after the other) into this rank's next slot and publish its number."""
        if self._pending is not None:  # collectives finish in order: the protocol relies on it
            pending, self._pending = self._pending, None
            pending.wait()
        self._sequence += 1
        sequence = self._sequence
        offset = 0
        slot = self._slot(sequence, self.rank, tensors[0].dtype, sum(t.numel() for t in tensors))
        for tensor in tensors:
            slot.narrow(0, offset, tensor.numel()).view_as(tensor).copy_(tensor)
            offset += tensor.numel()
        self._counters[self.rank].value = sequence
        return sequence

    def _wait_for_all(self, sequence: int, dtype: torch.dtype, numel: int) -> list[torch.Tensor]:
        """Wait until every rank has published `sequence`; their slots, as flat `dtype` tensors of `numel`."""
        deadline, spins = None, 0
        for rank, counter in enumerate(self._counters):
            while counter.value < sequence:
                spins += 1
                if spins < _SPINS_BEFORE_YIELD:
                    continue
                os.sched_yield()  # a peer may need this core (2 ranks on 2 cores)
                if spins % _SPINS_BEFORE_YIELD == 0:
                    now = time.monotonic()
                    deadline = deadline or now + self.timeout_s
                    if now > deadline:
                        raise RuntimeError(
                            f"shared-memory collective #{sequence} timed out after {self.timeout_s:.0f} s "
                            f"waiting for rank {rank} of its group (rank {self.rank} of {self.world})"
                        )
        return [self._slot(sequence, rank, dtype, numel) for rank in range(self.world)]


def _reduce_in_rank_order(reduce, slots: list[torch.Tensor], out: torch.Tensor) -> None:
    """`out` (contiguous) = slots[0] op slots[1] op ... in this order on every rank: the same bits everywhere."""
    out = out.view(-1)
    reduce(slots[0], slots[1], out=out)
    for slot in slots[2:]:
        reduce(out, slot, out=out)


def _header_bytes(world: int) -> int:
    used = world * _CACHE_LINE + _TOKEN_BYTES
    return -(-used // mmap.PAGESIZE) * mmap.PAGESIZE


# -- one SharedMemoryGroup per process group, made on its first collective ----------------------------------

_groups: weakref.WeakKeyDictionary[ProcessGroup, SharedMemoryGroup | None] = weakref.WeakKeyDictionary()
_SUPPORTED_DTYPES = {torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64}


def shared_memory_group(group: ProcessGroup, tensor: torch.Tensor) -> SharedMemoryGroup | None:
    """The shared-memory collectives of `group` for `tensor`, or None to use torch.distributed.

    Made (collectively) on the group's first CPU collective; every rank takes the same decision.
    """
    if not devices.is_host(tensor) or tensor.dtype not in _SUPPORTED_DTYPES:
        return None
    if group not in _groups:
        _groups[group] = _connect(group)
    return _groups[group]


def _wanted(group: ProcessGroup) -> bool:
    if os.environ.get(_ENV_SWITCH, "1") == "0" or ranks.world_size(group) < 2:
        return False
    if platform.system() != "Linux" or platform.machine().lower() not in {"x86_64", "amd64"}:
        return False
    return dist.get_backend(group) == "gloo" and os.path.isdir(_SHM_DIR)


def _connect(group: ProcessGroup) -> SharedMemoryGroup | None:
    """Rank 0 of `group` makes the file; every rank maps it and checks the token rank 0 wrote (same memory,
    not merely the same path); all of them use it only if every rank could."""
    rank, world = ranks.rank(group), ranks.world_size(group)
    size = _header_bytes(world) + 2 * world * CAPACITY
    offer: list = [None]
    if rank == 0 and _wanted(group):
        offer = [_make_file(size, world)]
    dist.broadcast_object_list(offer, group_src=0, group=group)
    if offer[0] is None:
        return None
    path, token = offer[0]
    mapping = _map_file(path, size, world, token)
    mapped: list = [None] * world
    dist.all_gather_object(mapped, mapping is not None, group=group)  # also: everyone is done opening
    if rank == 0:
        os.unlink(path)
    if not all(mapped):
        return None
    options = group._get_backend(torch.device("cpu")).options  # its timeout follows the group's (mesh/timeouts.py)
    return SharedMemoryGroup(mapping, rank, world, lambda: options._timeout.total_seconds())


def _make_file(size: int, world: int) -> tuple[str, bytes] | None:
    try:
        fd, path = tempfile.mkstemp(prefix="optimum_parallel_", dir=_SHM_DIR)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, size)  # fails now, not with SIGBUS later, when /dev/shm is too small
        token = secrets.token_bytes(_TOKEN_BYTES)
        os.pwrite(fd, token, _token_offset(world))
        return path, token
    except OSError:
        os.unlink(path)
        return None
    finally:
        os.close(fd)


def _map_file(path: str, size: int, world: int, token: bytes) -> mmap.mmap | None:
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != size or os.pread(fd, _TOKEN_BYTES, _token_offset(world)) != token:
            return None
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _token_offset(world: int) -> int:
    return world * _CACHE_LINE  # in the header, after the counters
