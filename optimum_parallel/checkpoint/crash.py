"""Fault injection for the crash tests: named points inside a save where a process can be made to die."""

from __future__ import annotations

import os
import signal

CRASH_ENV = "OPTIMUM_PARALLEL_CRASH_AT"
_reached: dict[str, int] = {}


def crash_point(name: str) -> None:
    """SIGKILL this process the n-th time it reaches `name` when `OPTIMUM_PARALLEL_CRASH_AT` is "name:n" (counted
    from when the variable is set); unset, as in every real run, this is one environment lookup."""
    target = os.environ.get(CRASH_ENV)
    if not target:
        return
    _reached[name] = _reached.get(name, 0) + 1
    if target == f"{name}:{_reached[name]}":
        os.kill(os.getpid(), signal.SIGKILL)
