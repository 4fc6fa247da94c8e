"""One line on every survivor when a collective fails because a rank never came: which collective, which group, which
ranks are missing. `install` adds the report to `sys.excepthook`: each surviving rank posts the collective it failed in
to the rendezvous store and prints the line before the usual traceback. Design notes: docs/module_notes.md.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch.distributed as dist

from . import heartbeat

_PREFIX = "optimum_parallel/failed_collective/"
_MARKERS = ("timed out", "connection closed", "connection reset", "broken pipe", "timeout")
_names: dict[int, str] = {}  # id(process group) -> its mesh dim
_installed = False


def install(group_names: dict[dist.ProcessGroup, str], grace: timedelta) -> None:
    """Report failed collectives of these groups (and any other) through `sys.excepthook`; once per process."""
    global _installed
    _names.update({id(group): name for group, name in group_names.items()})
    if _installed:
        return
    _installed = True
    previous = sys.excepthook

    def hook(kind, error, trace) -> None:
        heartbeat.mark_ending()  # its watcher must not end this process before the report is out
        # torchrun SIGTERMs every rank once the first one exits: let this one finish its report first
        terminate = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            line = _report(error, trace, grace.total_seconds())
            if line:
                _write_line(line)
        except Exception:  # the report is best effort: the original error is what matters
            pass
        finally:
            signal.signal(signal.SIGTERM, terminate)
        previous(kind, error, trace)

    sys.excepthook = hook


def _write_line(line: str) -> None:
    """`line` and its newline in one write: the ranks share torchrun's stderr pipe, where a write under 4 KiB is
    atomic (print's two writes let another rank's line land between a line and its newline)."""
    try:
        sys.stderr.flush()
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    except (AttributeError, OSError, ValueError):  # a stderr without a file descriptor (replaced, captured)
        print(line, file=sys.stderr, flush=True)


def _failed_collective(error: BaseException, trace) -> tuple[str, dist.ProcessGroup | None] | None:
    """(collective name, its group) when `error` was raised waiting in a torch.distributed collective."""
    if not any(marker in str(error).lower() for marker in _MARKERS):
        return None
    found = None
    for frame, _ in traceback.walk_tb(trace):
        if frame.f_code.co_filename.endswith("distributed_c10d.py") and "group" in frame.f_locals:
            found = (frame.f_code.co_name, frame.f_locals["group"])  # the innermost public collective
    return found


def _report(error: BaseException, trace, grace_s: float) -> str | None:
    found = _failed_collective(error, trace)
    if found is None or not dist.is_initialized():
        return None
    collective, group = found
    group = group if group is not None else dist.group.WORLD
    me, world = dist.get_rank(), dist.get_world_size()
    ranks = dist.get_process_group_ranks(group)
    name = _names.get(id(group), "world" if len(ranks) == world else "")
    store = dist.distributed_c10d._get_default_store()
    reported: set[int] = {me}
    deadline = time.monotonic() + grace_s
    try:
        store.set(f"{_PREFIX}{me}", collective)
        while True:
            reported = {r for r in range(world) if store.check([f"{_PREFIX}{r}"])}
            if len(reported) == world or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    except Exception:  # the store's host (torchrun's agent) shuts down once a rank exited: report what was seen
        pass
    missing_here = [r for r in ranks if r not in reported]
    missing = [r for r in range(world) if r not in reported]
    where = f"the {name} group" if name else "a group"
    return (
        f"[optimum-parallel] rank {me}: {collective} on {where} (ranks {', '.join(map(str, ranks))}) failed "
        f"({_reason(error)}); missing in that group: {_listed(missing_here)}; ranks that "
        f"never reported a failed collective (stuck elsewhere or dead): {_listed(missing)}"
    )


def _reason(error: BaseException) -> str:
    """gloo's message without its source location: "Timed out waiting 5000ms for recv operation to complete"."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return first.rpartition("] ")[2][:120]


def _listed(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) if ranks else "none"
