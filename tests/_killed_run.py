"""A torchrun job killed with SIGKILL once every rank reached a given point (mid-save, after a save).

torchrun starts its ranks in their own sessions, so killing torchrun's process group leaves them running:
each rank records its pid when it gets there, and the test kills the ranks themselves, then torchrun.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


def mark_reached(marker: str | Path) -> None:
    """In a rank: this rank got to the point where it is to be killed."""
    Path(f"{marker}.pid{os.environ['RANK']}").write_text(str(os.getpid()))


def run_until_reached_then_kill(command: list[str], env: dict, marker: Path, ranks: int, timeout: float = 120) -> None:
    """Run `command` (torchrun ...) until `ranks` ranks called `mark_reached(marker)`, then SIGKILL them all."""
    proc = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pid_files = lambda: sorted(marker.parent.glob(f"{marker.name}.pid*"))  # noqa: E731
    try:
        deadline = time.monotonic() + timeout
        while len(pid_files()) < ranks:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, f"the ranks never reached {marker.name}"
            time.sleep(0.2)
    finally:
        for pid_file in pid_files():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
