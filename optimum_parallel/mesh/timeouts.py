"""Process-group timeouts that let a slow rank through, while the heartbeat (heartbeat.py) tells a dead one.
`Timeouts` holds a job's two timeouts: `init`, until this process's first optimizer step ends, and `train` after it.
`configure` (called by `init_mesh`) sets them on every process group and switches from one to the other;
`long_running` / `long_running_call` put `init` back around a save, a load or a compile. Design notes:
docs/module_notes.md.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import device as devices
from . import phase

WATCHED_TIMEOUT = timedelta(minutes=30)  # every phase while the heartbeat runs: transformers' ddp_timeout
INIT_TIMEOUT = timedelta(minutes=10)  # until the first optimizer step ends, and around saves, loads and compiles
TRAIN_TIMEOUT = timedelta(minutes=2)  # afterwards: a stuck (not dead) rank fails the job this long after

_F = TypeVar("_F", bound=Callable)


@dataclass(frozen=True)
class Timeouts:
    """The two collective timeouts of a job: `init` while ranks may drift apart, `train` once training runs."""

    init: timedelta = INIT_TIMEOUT
    train: timedelta = TRAIN_TIMEOUT

    @classmethod
    def of(
        cls,
        timeout: Timeouts | timedelta | float | None = None,
        train_timeout: timedelta | float | None = None,
        *,
        watched: bool = False,
    ) -> Timeouts:
        """From `init_mesh`'s arguments: `timeout` a Timeouts, or the init timeout (seconds or a timedelta; None: 10
        minutes, 30 when `watched`); `train_timeout` the steady-state one (None: 2 minutes, or `timeout` if that is
        shorter; with `watched`, the init one). `watched`: the heartbeat decides when a rank is dead. Raises
        ValueError naming the key for a timeout <= 0 or of another type."""
        if isinstance(timeout, Timeouts):
            if train_timeout is not None:
                raise ValueError("pass train_timeout inside the Timeouts given as timeout=, not beside it")
            return cls(_seconds("timeout.init", timeout.init), _seconds("timeout.train", timeout.train))
        init = (WATCHED_TIMEOUT if watched else INIT_TIMEOUT) if timeout is None else _seconds("timeout", timeout)
        if train_timeout is not None:
            return cls(init, _seconds("train_timeout", train_timeout))
        return cls(init, init if watched else min(TRAIN_TIMEOUT, init))


def _seconds(key: str, value: object) -> timedelta:
    if isinstance(value, bool) or not isinstance(value, (int, float, timedelta)):
        raise ValueError(f"{key}={value!r} is not a timeout; allowed: seconds (a number > 0) or a timedelta > 0")
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not 0 < seconds < float("inf"):  # also NaN
        raise ValueError(f"{key}={value!r}: a timeout must be > 0 seconds (allowed: a number > 0 or a timedelta > 0)")
    return value if isinstance(value, timedelta) else timedelta(seconds=seconds)


class _State:
    """This process's timeouts and phase: training once its first optimizer step ended; `long` open spans."""

    def __init__(self) -> None:
        self.timeouts: Timeouts | None = None
        self.training = False
        self.long = 0
        self.hook = None
        self.watching_compiles = False
        self.lock = threading.Lock()


_STATE = _State()


def configure(timeouts: Timeouts) -> None:
    """Use `timeouts` from now on (the init one until the next first optimizer step ends); arm the switch."""
    with _STATE.lock:
        _STATE.timeouts, _STATE.training = timeouts, False
        if _STATE.hook is None:
            _STATE.hook = register_optimizer_step_post_hook(_first_step_ended)
    _watch_compiles()
    apply()


def configured() -> Timeouts | None:
    return _STATE.timeouts


def current() -> timedelta | None:
    """The timeout every group has now: `init` before the first optimizer step ended or inside `long_running`,
    else `train`; None before `configure`."""
    timeouts = _STATE.timeouts
    if timeouts is None:
        return None
    return timeouts.train if _STATE.training and _STATE.long == 0 else timeouts.init


def is_training() -> bool:
    """Whether this process's first optimizer step has ended (the steady-state timeout is on)."""
    return _STATE.training


def _first_step_ended(optimizer, args, kwargs) -> None:
    """torch.optim's post-hook of every optimizer's step: the first one switches to the train timeout, once."""
    with _STATE.lock:
        if _STATE.hook is not None:
            _STATE.hook.remove()
            _STATE.hook = None
        _STATE.training = True
    _watch_compiles()
    apply()


@contextlib.contextmanager
def long_running(what: str) -> Iterator[None]:
    """The init timeout for every group while `what` (a save, a load, a compile) runs, where one rank may take
    minutes longer than the others; the previous timeout after it. Nests."""
    with _STATE.lock:
        _STATE.long += 1
    phase.enter(what)
    apply()
    try:
        yield
    finally:
        with _STATE.lock:
            _STATE.long -= 1
        phase.leave(what)
        apply()


def _watch_compiles() -> None:
    """Every later torch.compile compilation (a recompile on a new shape) runs under the init timeout: dynamo's
    start/end callbacks, registered once dynamo is imported (the first compiles fall in the first step anyway;
    importing dynamo for this would cost every process seconds)."""
    if _STATE.watching_compiles or "torch._dynamo" not in sys.modules:
        return
    from torch._dynamo.callback import callback_handler

    callback_handler.register_start_callback(_compile_started)
    callback_handler.register_end_callback(_compile_ended)
    _STATE.watching_compiles = True


def _compile_started(*_) -> None:
    with _STATE.lock:
        _STATE.long += 1
    phase.enter("compile")
    apply()


def _compile_ended(*_) -> None:
    with _STATE.lock:
        _STATE.long = max(0, _STATE.long - 1)
    phase.leave("compile")
    apply()


def long_running_call(what: str) -> Callable[[_F], _F]:
    """Decorator: the function runs inside `long_running(what)`."""

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with long_running(what):
                return fn(*args, **kwargs)

        return run  # type: ignore[return-value]

    return wrap


def apply() -> None:
    """Give every process group of this process the current timeout (nothing before `configure` or without a
    default group)."""
    timeout = current()
    if timeout is None or not dist.is_initialized() or devices.xla_requested():  # XLA: torch-xla's runtime waits
        return
    for group in list(dist.distributed_c10d._world.pg_map):
        set_group_timeout(group, timeout)


def set_group_timeout(group: dist.ProcessGroup, timeout: timedelta) -> None:
    """`timeout` on every backend of `group` (torch's `ProcessGroup.set_timeout`; `_set_pg_timeout` where a torch
    lacks it); a backend that cannot change its timeout keeps the one it was made with."""
    try:
        group.set_timeout(timeout)
    except (AttributeError, NotImplementedError, RuntimeError):
        with (
            warnings.catch_warnings(),
            contextlib.suppress(AttributeError, NotImplementedError, RuntimeError, ValueError),
        ):
            warnings.simplefilter("ignore")  # "only supported for nccl or gloo": the others keep theirs, as said
            dist.distributed_c10d._set_pg_timeout(timeout, group)


def group_timeout(group: dist.ProcessGroup) -> timedelta | None:
    """The timeout `group`'s CPU backend waits now (None where it has none or does not say)."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None


NCCL_REPORT_DEFAULTS = {
    # a timed-out NCCL collective aborts in torch's watchdog thread, before any Python hook can report: let the
    # watchdog dump its flight recorder (the last collectives of every group, with their state) first
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
}


def nccl_report_defaults() -> None:
    """Turn torch's NCCL flight recorder on, where the user set nothing else, so a timeout leaves a report (under
    TORCH_NCCL_DEBUG_INFO_TEMP_FILE, /tmp/nccl_trace_rank_<rank> by default; read it with torch's `fr_trace`).
    Read when an NCCL group is made: call before `init_process_group`."""
    for name, value in NCCL_REPORT_DEFAULTS.items():
        os.environ.setdefault(name, value)
