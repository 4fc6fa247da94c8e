"""The default group this package made is destroyed when the process ends cleanly, before the interpreter finalizes.

gloo runs each collective on a worker thread, which drops its last reference to the collective's tensors a moment
after the caller's wait returns. When the process ends straight after a collective (a Trainer's last metrics
all-gather), the thread can drop it while Python finalizes: the decref takes the GIL, the thread exits in
`take_gil` and the process aborts ("terminate called without an active exception", 3 runs in 29 of the GRPO
example; core: `~AsyncAllgatherWork` -> `decref_pyobject` -> `PyThread_exit_thread`). `destroy_process_group` at
exit joins those threads while Python still runs, as torch asks every program to do. Only after a clean end: after an
uncaught exception (`sys.last_value`) a collective may still wait on a peer, and joining it would keep a failed rank
alive until the timeout instead of ending the job at once.
"""

from __future__ import annotations

import atexit
import sys

import torch.distributed as dist

_REGISTERED: list[bool] = []


def destroy_at_clean_exit() -> None:
    """Register (once) the exit hook that destroys the default group when the process ends without an error."""
    if not _REGISTERED:
        atexit.register(_destroy_if_clean)
        _REGISTERED.append(True)


def _destroy_if_clean() -> None:
    if hasattr(sys, "last_value") or not dist.is_initialized():  # a crash, or the program destroyed it itself
        return
    dist.destroy_process_group()
