"""Asynchronous sharded saves: each rank snapshots its shards in host memory, a background thread writes, checksums
and publishes them while training goes on; the files are the blocking save's, byte for byte.

The weights and optimizer state are copied by the thread before the next optimizer step (a step pre-hook waits for
the copy, not the write). Design notes and measurements: docs/module_notes.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..io.fresh_memory import populated_empty
from ..mesh import device as devices
from ..mesh import get_mesh, ranks
from .crash import crash_point

if TYPE_CHECKING:
    from .collect import LocalTensor
    from .save import PlannedSave

_ALIGN = 64  # each tensor's copy starts on a cache line (and on its dtype's alignment)
_PENDING: AsyncCheckpoint | None = None
# How the writer thread is scheduled against training ("nice": nice 19; "idle": SCHED_IDLE, it runs only when a core
# would idle; "normal"): scripts/bench_checkpoint.py measures the three (see the docstring).
WRITER_POLICY = "nice"
# Where the weights and optimizer state are copied: "overlap", in the background before the optimizer's next step
# (which waits for the copy); "step", in the call, as a save with no optimizer to wait in does (the benchmark's
# reference).
COPY_POLICY = "overlap"
_GROUP: list = [None, None]  # [the default group it was made in, the background thread's group]


class AsyncCheckpoint:
    """A checkpoint being written in the background. `wait()` blocks until it is renamed into place and returns its
    path, or raises the error of its write (on every rank, whichever rank failed); `wait_for_copy()` blocks until
    the snapshot is complete, after which the live weights and optimizer state may change."""

    def __init__(self, path: Path, snapshot_bytes: int) -> None:
        self.path = path
        self.snapshot_bytes = snapshot_bytes  # this rank's copy in host memory, freed once its files are written
        # of it: {"step": copied in the call, "background": copied by the thread, "kept": FSDP2 gathers held as made}
        self.copy_bytes = {"step": 0, "background": 0, "kept": 0}
        self.copy_waited = 0.0  # seconds the training thread waited for the background copy (its hooks)
        self._done = threading.Event()
        self._copied = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._hooks: list = []  # the optimizer's step pre-hook and the model's load_state_dict pre-hook
        self.started_at = time.perf_counter()
        self.copied_at: float | None = None  # perf_counter() when the snapshot was complete
        self.finished_at: float | None = None  # perf_counter() when the write ended (renamed into place, or failed)

    def done(self) -> bool:
        """Whether the background write ended (renamed into place, or failed)."""
        return self._done.is_set()

    def copy_done(self) -> bool:
        """Whether the snapshot is complete (the live tensors are free to change)."""
        return self._copied.is_set()

    def wait_for_copy(self, timeout: float | None = None) -> None:
        """Block until the snapshot is complete (what the optimizer's next `step()` does first); an error of the copy
        is raised by `wait()`, not here."""
        if self._copied.is_set():
            return
        start = time.perf_counter()
        if not self._copied.wait(timeout):
            raise TimeoutError(f"the async save of {self.path} is still copying its snapshot after {timeout} s")
        self.copy_waited += time.perf_counter() - start

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

    def _remove_hooks(self) -> None:
        """On the training thread (the hook dictionaries are iterated there, never changed from the writer's)."""
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook.remove()

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "complete" if self.done() else "writing"
        return f"AsyncCheckpoint({str(self.path)!r}, {state})"


def _delivered(handle: AsyncCheckpoint) -> None:
    """`handle` was waited for (its error, if any, raised to the caller): no save waits for it again."""
    global _PENDING
    handle._remove_hooks()
    if _PENDING is handle:
        _PENDING = None


def wait_for_pending_save() -> Path | None:
    """Wait for the async save in flight in this process, if any: its path, or its error raised (once: a save waited
    for, here or by its handle, is not waited for again). Every save calls it first; call it before
    `dist.destroy_process_group()`."""
    return None if _PENDING is None else _PENDING.wait()


def wait_for_pending_copy() -> None:
    """Wait until the snapshot of the async save in flight, if any, is complete: before anything changes the weights
    or optimizer state in place other than the optimizer's step (which waits by itself): `load_model_checkpoint`
    calls it."""
    if _PENDING is not None:
        _PENDING.wait_for_copy()


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


def _hookable(optimizer: object) -> bool:
    """Whether `optimizer.step()` runs step pre-hooks: a `torch.optim.Optimizer` whose class torch patched (its
    `__init__` ran). Anything else (None, a duck-typed optimizer) cannot make the step wait for the copy."""
    return isinstance(optimizer, torch.optim.Optimizer) and bool(getattr(type(optimizer).step, "hooked", False))


def _is_copy(held: LocalTensor, value: torch.Tensor) -> bool:
    """Whether `value` is memory the save's walk made (an FSDP2 shard's all-gather), not the live tensor's."""
    if not held.sharded_over_dp:
        return False
    live = held.tensor.to_local().untyped_storage().data_ptr()
    return value.untyped_storage().data_ptr() not in (live, 0)


def _when(held: LocalTensor, value: torch.Tensor, overlap: bool) -> str:
    """When `value` is copied into the snapshot: "kept" (a copy already, on the host: held as it is), "step" (in the
    call) or "background" (before the optimizer's next step)."""
    if _is_copy(held, value):
        return "kept" if devices.is_host(value) else "step"  # device memory is not held past the call
    if held.kind == "buffer":  # a forward may change buffers in place (BatchNorm's statistics, DDP's broadcast)
        return "step"
    return "background" if overlap else "step"


def _aligned(value: torch.Tensor) -> int:
    return -(-(value.numel() * value.element_size()) // _ALIGN) * _ALIGN


def _accelerators(items: list[list]) -> set[torch.device]:
    """The accelerator devices the items' tensors live on."""
    return {item[1].device for item in items if not (devices.is_host(item[1]) or item[1].is_meta)}


def _fill(items: list[list], point: str, ready: dict | None = None) -> dict:
    """Copy every item's tensor ([shard, tensor, when]) into one new host buffer (pinned where they live on an
    accelerator) and put the copy in its place. In the call (`ready` None) device copies are queued on the current
    streams: {device: event} the write waits for; in the background they run on a stream of their own that first
    waits for `ready` (the training stream at the call) and are complete on return."""
    places = _accelerators(items)
    pinned = bool(places) and torch.accelerator.is_available() and not devices.lacks_pinned_memory()
    sizes = [_aligned(item[1]) for item in items]
    if pinned:
        buffer = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=True)
    else:
        buffer = populated_empty((sum(sizes),), torch.uint8)  # its pages faulted in at once (io/fresh_memory.py)
    streams = {d: torch.Stream(device=d) for d in places} if pinned and ready is not None else {}
    for device, stream in streams.items():
        stream.wait_event(ready[device])
    start = 0
    for item, size in zip(items, sizes, strict=True):
        value = item[1].detach()
        copy = buffer[start : start + value.numel() * value.element_size()].view(value.dtype).view(value.shape)
        stream = streams.get(value.device)
        with stream if stream is not None else contextlib.nullcontext():
            copy.copy_(value, non_blocking=pinned)
        item[1] = copy
        start += size
        crash_point(point)
    for stream in streams.values():
        stream.synchronize()
    if pinned and ready is None:
        return {d: torch.accelerator.current_stream(d).record_event() for d in places}
    return {}


def _snapshot(save: PlannedSave, overlap: bool) -> tuple[dict[str, list], list[list], dict, dict]:
    """({file: [[shard, tensor, when]]} of this rank's files, the items to copy in the background, {device: event}
    of the training streams they wait for, {device: event} of the copies queued in the call), after the collective
    walk of a blocking save's write (FSDP2 all-gathers, in the call) and the copies that cannot wait."""
    items: dict[str, list] = {}
    for file, _, _, _ in save.files():
        for shard, held, value in save.snapshot_values(file):
            items.setdefault(file, []).append([shard, value, _when(held, value, overlap)])
    every = [item for file_items in items.values() for item in file_items]
    queued = _fill([item for item in every if item[2] == "step"], "snapshot")
    later = [item for item in every if item[2] == "background"]
    ready = {d: torch.accelerator.current_stream(d).record_event() for d in _accelerators(later)}
    return items, later, ready, queued


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


def start_async_save(
    save: PlannedSave, group: dist.ProcessGroup | None, step_optimizer: torch.optim.Optimizer | None
) -> AsyncCheckpoint:
    """Snapshot this rank's shards (the weights and optimizer state in the background before `step_optimizer`'s next
    step, where it can wait), write and publish them in a background thread; the handle of the save."""
    global _PENDING
    started = time.perf_counter()
    overlap = COPY_POLICY == "overlap" and _hookable(step_optimizer)
    try:
        items, later, ready, queued = _snapshot(save, overlap)
    except BaseException:
        save.abandon()
        raise
    save.local = {"model": {}, "state": {}}  # what the snapshot still needs, its items hold
    every = [item for file_items in items.values() for item in file_items]
    handle = AsyncCheckpoint(save.final, sum(_aligned(item[1]) for item in every))
    handle.started_at = started
    for item in every:
        handle.copy_bytes[item[2]] += item[1].numel() * item[1].element_size()
    if later:  # the live tensors may not change before the copy is made: the optimizer's step and loads wait for it
        model = save.model

        def before_step(_optimizer: object, _args: object, _kwargs: object) -> None:
            handle.wait_for_copy()

        def before_load(*_args: object) -> None:
            handle.wait_for_copy()

        handle._hooks = [
            step_optimizer.register_step_pre_hook(before_step),
            model.register_load_state_dict_pre_hook(before_load),
        ]
    else:
        handle.copied_at = time.perf_counter()
        handle._copied.set()
    if save.rank.is_main:
        per_rank: dict[str, int] = {}
        for file, n in save.file_bytes().items():  # a writing rank's files: model-<coords> and optimizer-<coords>
            per_rank[file.partition("-")[2]] = per_rank.get(file.partition("-")[2], 0) + n
        most = max(per_rank.values(), default=0)
        took = time.perf_counter() - started
        parts = [
            f"{_gib(handle.copy_bytes['step'])} copied in the call" if handle.copy_bytes["step"] else "",
            f"{_gib(handle.copy_bytes['background'])} to copy in the background before the optimizer's next step"
            if later
            else "",
            f"{_gib(handle.copy_bytes['kept'])} all-gathered in the call and kept" if handle.copy_bytes["kept"] else "",
        ]
        print(
            f"[optimum-parallel] async save of {save.final}: snapshot of {_gib(handle.snapshot_bytes)} in host memory "
            f"on rank 0 (largest rank {_gib(most)}, {_gib(sum(per_rank.values()))} over {len(per_rank)} writing "
            f"ranks): {', '.join(p for p in parts if p) or 'nothing'} ({took:.2f} s in the call); writing in the "
            "background",
            flush=True,
        )
    holder = {"items": items, "later": later}
    del items, later, every
    rank = dataclasses.replace(save.rank, group=group)

    def copy_then_write() -> dict:
        try:
            _fill(holder.pop("later"), "copy", ready)  # at the caller's priority: the next step may be waiting
            for event in queued.values():  # the copies queued in the call
                event.synchronize()
        finally:
            handle.copied_at = time.perf_counter()
            handle._copied.set()
        _lower_priority(WRITER_POLICY)
        files = holder["items"]
        return save.write(lambda file: [(shard, copy) for shard, copy, _ in files.get(file, ())])

    def run() -> None:
        try:
            try:
                written = rank.run(copy_then_write, f"writing shards into {save.tmp}")
            finally:
                holder.clear()  # the snapshot is freed here, before the rename
            rank.run(lambda: save.publish(written), f"publishing {save.final}", only_main=True)
        except BaseException as err:  # noqa: BLE001 - kept for wait(), raised on the caller's thread
            save.abandon()
            handle._error = err
        finally:
            handle._copied.set()
            handle.finished_at = time.perf_counter()
            handle._done.set()

    # not a daemon: a script that ends without waiting still finishes its last checkpoint before exiting
    handle._thread = threading.Thread(target=run, name=f"optimum-parallel async save {save.final.name}")
    try:
        handle._thread.start()
    except BaseException:
        handle._remove_hooks()
        handle._copied.set()
        save.abandon()
        raise
    _PENDING = handle
    return handle
