"""Asynchronous sharded saves: each rank copies its shards to host memory in the step, a background thread writes,
checksums and publishes them while training goes on.

The step pays for the plan (two small exchanges), the FSDP2 all-gathers / ZeRO-1 consolidation a blocking save does
too, and one copy of the rank's shards into a single host buffer (pinned where the tensors live on an accelerator);
the thread then runs the blocking save's own `write` and `publish` (`save.PlannedSave`) on that copy, so the files,
their index and checksums are the blocking save's, byte for byte, written into `.<name>.partial` and renamed last.

- A thread, not a process: the writing is `os.write`, sha256 and crc32, which release the GIL on buffers this
  size, and the snapshot is already in this process's memory. Measured (scripts/bench_checkpoint.py, 0.5B at tp=2,
  2 runs): at the same nice 19, steps beside the thread ran 0.96-0.98x the steps without a write, beside a process
  doing the same writing from shared memory 0.98-1.02x, and the thread finished in 54 s against 75-105 s.
- The thread runs at nice 19: at normal priority it halves training's share of the cores (steps 1.73-1.87x, total
  15-23 s); at SCHED_IDLE steps were not slower (0.72-0.81x: noise) but the write took 86-95 s, and on a machine
  that never idles it could starve.
- One save in flight per process: any save (blocking or not) first waits for the one in flight and raises its error,
  so at most one snapshot is held; it is freed as soon as its files are written, before the rename.
- The thread exchanges on a gloo group of its own (made once, like torch DCP's async_save does), never on the groups
  training uses; every rank learns every rank's outcome there, so an error in any rank's background write is raised
  on every rank: by `.wait()`, by the next save, or by whoever calls `wait_for_pending_save()` (the Trainer: at
  the next save, `save_model()` and the end of training).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..io.fresh_memory import populated_empty
from ..mesh import get_mesh, ranks
from .crash import crash_point

if TYPE_CHECKING:
    from .save import PlannedSave

_ALIGN = 64  # each tensor's copy starts on a cache line (and on its dtype's alignment)
_PENDING: AsyncCheckpoint | None = None
# How the writer thread is scheduled against training ("nice": nice 19; "idle": SCHED_IDLE, it runs only when a core
# would idle; "normal"): scripts/bench_checkpoint.py measures the three (see the docstring).
WRITER_POLICY = "nice"
_GROUP: list = [None, None]  # [the default group it was made in, the background thread's group]


class AsyncCheckpoint:
    """A checkpoint being written in the background. `wait()` blocks until it is renamed into place and returns its
    path, or raises the error of its write (on every rank, whichever rank failed)."""

    def __init__(self, path: Path, snapshot_bytes: int) -> None:
        self.path = path
        self.snapshot_bytes = snapshot_bytes  # this rank's copy in host memory, freed once its files are written
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.started_at = time.perf_counter()
        self.finished_at: float | None = None  # perf_counter() when the write ended (renamed into place, or failed)

    def done(self) -> bool:
        """Whether the background write ended (renamed into place, or failed)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Path:
        """The checkpoint's path once it is complete; its error if the background write failed on any rank."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the async save of {self.path} is still being written after {timeout} s")
        if self._thread is not None:
            self._thread.join()
        _delivered(self)
        if self._error is not None:
            raise self._error
        return self.path

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "complete" if self.done() else "writing"
        return f"AsyncCheckpoint({str(self.path)!r}, {state})"


def _delivered(handle: AsyncCheckpoint) -> None:
    """`handle` was waited for (its error, if any, raised to the caller): no save waits for it again."""
    global _PENDING
    if _PENDING is handle:
        _PENDING = None


def wait_for_pending_save() -> Path | None:
    """Wait for the async save in flight in this process, if any: its path, or its error raised (once: a save waited
    for, here or by its handle, is not waited for again). Every save calls it first; call it before
    `dist.destroy_process_group()`."""
    return None if _PENDING is None else _PENDING.wait()


def check_async_supported() -> None:
    if ranks.on_xla():
        raise NotImplementedError(
            "save_model_checkpoint(async_save=True) on the xla backend: the background write exchanges over a gloo "
            "group, which torch-xla's process groups do not provide; allowed there: async_save=False"
        )


def background_group() -> dist.ProcessGroup | None:
    """The gloo group of every rank that background writes exchange on (None without torch.distributed); made on
    first use, by every rank at once (a collective of the default group), with the mesh's timeout."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if _GROUP[0] is not dist.group.WORLD:
        try:
            timeout = get_mesh().timeout
        except RuntimeError:  # no mesh: the default group's own
            timeout = None
        _GROUP[:] = [dist.group.WORLD, dist.new_group(backend="gloo", timeout=timeout)]
    return _GROUP[1]


def _pinned(save: PlannedSave) -> bool:
    """Whether the snapshot goes to pinned memory: the tensors live on an accelerator that has it."""
    devices = {t.tensor.device.type for kind in ("model", "state") for t in save.local[kind].values()}
    return bool(devices - {"cpu", "meta"}) and torch.accelerator.is_available()


def _snapshot(save: PlannedSave) -> tuple[dict[str, list], int, bool]:
    """({file: [(shard, copy)]} of this rank's files, bytes, pinned): one host buffer holding every shard this rank
    writes, filled from the live tensors (the same collective walk as a blocking save's write)."""
    writes = save.rank.writes_experts
    offsets, total = {}, 0
    for file, _, _, _ in save.files() if writes else ():
        for key, dtype, shape in save.shapes(file):
            offsets[(file, key)] = (total, dtype, shape)
            total += -(-(torch.Size(shape).numel() * dtype.itemsize) // _ALIGN) * _ALIGN
    pinned = _pinned(save) and total > 0
    if pinned:
        buffer = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    else:
        buffer = populated_empty((total,), torch.uint8)  # its pages faulted in at once (io/fresh_memory.py)
    copies: dict[str, list] = {}
    for file, _, _, _ in save.files():
        for shard, value in save.live_values(file):
            start, dtype, shape = offsets[(file, shard.key)]
            size = torch.Size(shape).numel() * dtype.itemsize
            copy = buffer[start : start + size].view(dtype).view(shape)
            copy.copy_(value.detach(), non_blocking=pinned)
            copies.setdefault(file, []).append((shard, copy))
            crash_point("snapshot")
    if pinned:
        torch.accelerator.synchronize()
    return copies, total, pinned


def _lower_priority(policy: str) -> None:
    """Schedule the calling thread (Linux: per thread) after training's: nice 19, or SCHED_IDLE."""
    try:
        if policy == "idle":
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        elif policy == "nice":
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # another OS: the thread keeps its priority
        pass


def _gib(n: float) -> str:
    unit, scale = next(((u, s) for u, s in (("GiB", 1 << 30), ("MiB", 1 << 20)) if n >= s), ("KiB", 1 << 10))
    return f"{n / scale:.2f} {unit}"


def start_async_save(save: PlannedSave, group: dist.ProcessGroup | None) -> AsyncCheckpoint:
    """Snapshot this rank's shards now, write and publish them in a background thread; the handle of the save."""
    global _PENDING
    started = time.perf_counter()
    try:
        copies, size, pinned = _snapshot(save)
    except BaseException:
        save.abandon()
        raise
    save.local = {"model": {}, "state": {}}  # the live tensors (and ZeRO-1's consolidated state) are not needed now
    handle = AsyncCheckpoint(save.final, size)
    handle.started_at = started
    if save.rank.is_main:
        per_rank: dict[str, int] = {}
        for file, n in save.file_bytes().items():  # a writing rank's files: model-<coords> and optimizer-<coords>
            per_rank[file.partition("-")[2]] = per_rank.get(file.partition("-")[2], 0) + n
        most = max(per_rank.values(), default=0)
        took = time.perf_counter() - started
        print(
            f"[optimum-parallel] async save of {save.final}: snapshot of {_gib(size)} in {'pinned ' if pinned else ''}"
            f"host memory on rank 0 (largest rank {_gib(most)}, {_gib(sum(per_rank.values()))} over "
            f"{len(per_rank)} writing ranks), copied in {took:.2f} s; writing in the background",
            flush=True,
        )
    holder = {"copies": copies}
    del copies
    rank = dataclasses.replace(save.rank, group=group)

    def run() -> None:
        _lower_priority(WRITER_POLICY)
        try:
            try:
                written = rank.run(
                    lambda: save.write(lambda file: holder["copies"].get(file, ())), f"writing shards into {save.tmp}"
                )
            finally:
                holder.clear()  # the snapshot is freed here, before the rename
            rank.run(lambda: save.publish(written), f"publishing {save.final}", only_main=True)
        except BaseException as err:  # noqa: BLE001 - kept for wait(), raised on the caller's thread
            save.abandon()
            handle._error = err
        finally:
            handle.finished_at = time.perf_counter()
            handle._done.set()

    # not a daemon: a script that ends without waiting still finishes its last checkpoint before exiting
    handle._thread = threading.Thread(target=run, name=f"optimum-parallel async save {save.final.name}")
    handle._thread.start()
    _PENDING = handle
    return handle
