"""The default group this package made is destroyed when the process ends cleanly, before the interpreter finalizes,
and the exit never waits more than a few seconds for it.

gloo runs each collective on a worker thread, which drops its last reference to the collective's tensors a moment
after the caller's wait returns. When the process ends straight after a collective (a Trainer's last metrics
all-gather), the thread can drop it while Python finalizes: the decref takes the GIL, the thread exits in
`take_gil` and the process aborts ("terminate called without an active exception", 3 runs in 29 of the GRPO
example; core: `~AsyncAllgatherWork` -> `decref_pyobject` -> `PyThread_exit_thread`). `destroy_process_group` at
exit joins those threads while Python still runs, as torch asks every program to do. Only after a clean end: after an
uncaught exception (`sys.last_value`) a collective may still wait on a peer, and joining it would keep a failed rank
alive until the timeout instead of ending the job at once. Nor when the heartbeat (heartbeat.py) last saw a peer fail
or miss its beats, and never for longer than `DESTROY_WAIT_S`: under NCCL, destroying a group can block on work queued
to a dead peer, and a rank that finished must not hang its launcher's teardown.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

import torch.distributed as dist

from . import heartbeat

DESTROY_WAIT_S = 5.0
WORKER_HANDOFF_S = 0.3
_REGISTERED: list[bool] = []


def destroy_at_clean_exit() -> None:
    """Register (once) the exit hook that destroys the default group when the process ends without an error."""
    if not _REGISTERED:
        atexit.register(_destroy_if_clean)
        _REGISTERED.append(True)


def _destroy_if_clean() -> None:
    try:
        _destroy()
    finally:
        # gloo's worker threads drop a finished collective's last reference to its tensors a moment after the wait
        # returned, taking the GIL: given it here, not in finalization. Also when the program destroyed the group
        # itself (groups a mesh or a Trainer still holds keep their threads; 1 run in 15 of a 4-rank Trainer job
        # aborted so at its end)
        time.sleep(WORKER_HANDOFF_S)


def _destroy() -> None:
    if hasattr(sys, "last_value") or not dist.is_initialized():  # a crash, or the program destroyed it itself
        return
    if heartbeat.peers_in_trouble():  # a peer failed or went silent: its work may never complete
        return
    destroying = threading.Thread(target=dist.destroy_process_group, name="optimum-parallel-destroy", daemon=True)
    destroying.start()
    destroying.join(DESTROY_WAIT_S)
    if destroying.is_alive():
        message = (
            f"[optimum-parallel] destroy_process_group did not return within {DESTROY_WAIT_S:g} s at exit (a peer "
            "gone?); exiting without it\n"
        )
        try:
            os.write(sys.stderr.fileno(), message.encode())
        except (AttributeError, OSError, ValueError):
            pass
