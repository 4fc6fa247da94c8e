"""`destroy_at_clean_exit` registers an exit hook that destroys the default group when the process ends cleanly, before
the interpreter finalizes (gloo's worker threads could otherwise abort the exit). It skips the destroy after an
uncaught exception or when the heartbeat saw a peer fail or go silent, and never waits more than `DESTROY_WAIT_S`
seconds for it. Design notes: docs/module_notes.md.
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
