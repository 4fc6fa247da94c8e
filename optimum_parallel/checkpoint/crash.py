"""Fault injection for the crash tests: named points inside a save where a process can be made to die, or to slow
down (so that an async save's background copy is sure to overlap a training step)."""

from __future__ import annotations

import os
import signal
import time

CRASH_ENV = "OPTIMUM_PARALLEL_CRASH_AT"
SLOW_ENV = "OPTIMUM_PARALLEL_SLOW_AT"
_reached: dict[str, int] = {}


def crash_point(name: str) -> None:
    """SIGKILL this process the n-th time it reaches `name` when `OPTIMUM_PARALLEL_CRASH_AT` is "name:n" (counted
    from when the variable is set); sleep s seconds each time it reaches `name` when `OPTIMUM_PARALLEL_SLOW_AT` is
    "name:s". Unset, as in every real run, this is two environment lookups."""
    slow = os.environ.get(SLOW_ENV)
    if slow and slow.partition(":")[0] == name:
        time.sleep(float(slow.partition(":")[2]))
    target = os.environ.get(CRASH_ENV)
    if not target:
        return
    _reached[name] = _reached.get(name, 0) + 1
    if target == f"{name}:{_reached[name]}":
        os.kill(os.getpid(), signal.SIGKILL)
