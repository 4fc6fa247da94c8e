"""A rank's process, told apart from every other process of its host, so that a rank declared dead by the heartbeat
can be SIGKILLed by a live rank on the same machine.

Why: a frozen process (SIGSTOP, stuck in the kernel) cannot act on the SIGTERM torchrun sends when the job ends, and
torchrun's agent waits its --shutdown-timeout (30 s) before it sends SIGKILL, which alone would hold the job's end
past a minute. The identity is the kernel's boot id, the PID namespace, the PID and the process's start time (in
clock ticks since boot), so a recycled PID, another container or another machine never match (ranks in network
namespaces of one machine do: they are processes of one kernel). Linux only; elsewhere no
identity is given and nothing is killed.
"""

from __future__ import annotations

import os
import signal


def identity(pid: int | None = None) -> str | None:
    """The identity of `pid` (this process by default): "boot id:pid namespace:pid:start time", or None where /proc
    cannot say."""
    pid = os.getpid() if pid is None else pid
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")  # the namespace `pid` is read in: this process's
        with open(f"/proc/{pid}/stat") as f:
            started = f.read().rpartition(")")[2].split()[19]  # field 22: starttime (fields 3.. follow the name)
    except (OSError, IndexError):
        return None
    return f"{boot}:{namespace}:{pid}:{started}"


def kill_if_here(claimed: str) -> bool:
    """SIGKILL the process of `claimed` (another rank's `identity()`) if it runs on this machine, in this PID
    namespace, and is the same process (not a later one with a recycled PID). True when it was killed."""
    try:
        pid = int(claimed.split(":")[-2])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid() or identity(pid) != claimed:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        return False
    return True
