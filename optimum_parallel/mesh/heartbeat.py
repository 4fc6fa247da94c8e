"""A liveness signal of every rank that does not depend on collectives, so a dead or frozen rank ends the job within
seconds while a rank that is only slow is waited for. `start` runs this rank's heartbeat thread, which beats in the
job's rendezvous store and watches its peers' beats; `HeartbeatSettings` holds the interval between beats and the
seconds without one after which a rank counts as dead. `current`, `peers_in_trouble` and `mark_ending` serve the exit
hooks (clean_exit.py, hang_report.py). Design notes: docs/module_notes.md.
"""

from __future__ import annotations

import atexit
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from . import local_process, phase

ENV_INTERVAL = "OPTIMUM_PARALLEL_HEARTBEAT_INTERVAL"
ENV_DEAD_AFTER = "OPTIMUM_PARALLEL_HEARTBEAT_DEAD_AFTER"
INTERVAL_S = 2.0
# a frozen rank ignores the SIGTERM torchrun sends when the job ends: its agent waits --shutdown-timeout (30 s) before
# SIGKILL, so 15 s + a beat or two here ends such a job within 60 s of the freeze
DEAD_AFTER_S = 15.0
EXIT_CODE = 75  # EX_TEMPFAIL: a peer failed, not this rank; a restart may succeed
DONE, FAILED = "done", "failed"
_PREFIX = "optimum_parallel/heartbeat"
_VERDICT = "verdict"  # rank 0's word to the others: "<silent ranks>|why"
_STORE_OP_S = 5.0  # one store operation's longest wait (a frozen store host answers nothing)


@dataclass(frozen=True)
class HeartbeatSettings:
    """`interval`: seconds between beats (0: no heartbeat); `dead_after`: seconds without a beat that make a rank
    dead (at least twice the interval)."""

    interval: float = INTERVAL_S
    dead_after: float = DEAD_AFTER_S

    @property
    def on(self) -> bool:
        return self.interval > 0

    @classmethod
    def of(cls, interval: float | None = None, dead_after: float | None = None) -> HeartbeatSettings:
        """From `init_mesh`'s `heartbeat_interval` / `heartbeat_dead_after`, else the environment variables, else
        the defaults; raises ValueError naming the key and the allowed values."""
        interval_s = _number("heartbeat_interval", interval, ENV_INTERVAL, INTERVAL_S, allow_zero=True)
        dead_s = _number("heartbeat_dead_after", dead_after, ENV_DEAD_AFTER, DEAD_AFTER_S, allow_zero=False)
        if interval_s > 0 and dead_s < 2 * interval_s:
            raise ValueError(
                f"heartbeat_dead_after={dead_s:g} ({ENV_DEAD_AFTER}) is shorter than twice heartbeat_interval="
                f"{interval_s:g} ({ENV_INTERVAL}): one late beat would count as a death; allowed: dead_after >= "
                "2 x interval"
            )
        return cls(interval_s, dead_s)


def _number(key: str, value: object, variable: str, default: float, allow_zero: bool) -> float:
    allowed = "seconds, a number >= 0 (0 turns the heartbeat off)" if allow_zero else "seconds, a number > 0"
    shown = f"{key}={value!r}"
    if value is None:
        raw = os.environ.get(variable, "").strip()
        if not raw:
            return default
        shown = f"{variable}={raw!r}"
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{shown} is not a number; allowed: {allowed}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{shown} is not a number; allowed: {allowed}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{shown}; allowed: {allowed}")
    return float(value)


class _Heartbeat:
    """This rank's beat and watch, on a thread of its own (how they work: docs/module_notes.md)."""

    def __init__(self, settings: HeartbeatSettings) -> None:
        self.settings = settings
        self.group = dist.distributed_c10d._get_default_group()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        base = dist.distributed_c10d._get_default_store()
        store = base.clone()  # a connection of its own: the main thread may block in the store meanwhile
        store.set_timeout(timedelta(seconds=min(_STORE_OP_S, settings.dead_after / 3)))
        self.store = dist.PrefixStore(_PREFIX, store)
        self.watched = list(range(1, self.world)) if self.rank == 0 else [0]
        self.seen: dict[int, tuple[str, float]] = {}  # rank -> (its last beat, when it changed, this clock)
        self.finished: set[int] = set()  # said they are done: never judged again
        self.failed: set[int] = set()  # said they ended with an error
        self.count = 0
        self.writing = threading.Lock()  # a beat and the final status never cross: the status is the last word
        self.last_ok = time.monotonic()
        self.stopping = threading.Event()
        self.store.set(f"process/{self.rank}", local_process.identity() or "")
        self.beat()  # before the thread: a peer watching sees this rank at once
        self.thread = threading.Thread(target=self.run, name="optimum-parallel-heartbeat", daemon=True)
        self.thread.start()

    def beat(self) -> None:
        with self.writing:
            if self.stopping.is_set():
                return
            self.count += 1
            self.store.set(str(self.rank), f"{self.count}|{phase.describe()}")

    def run(self) -> None:
        while not self.stopping.wait(self.settings.interval):
            if not dist.is_initialized() or dist.distributed_c10d._get_default_group() is not self.group:
                self.stop(DONE)  # the program destroyed its group: it is ending, or starting another
                return
            if _ENDING.is_set():  # its own error report and exit run now; atexit marks it failed
                return
            try:
                self.tick()
            except Exception as err:  # noqa: BLE001  (never let the watcher die quietly: say why, keep beating)
                _write_line(f"[optimum-parallel] heartbeat on rank {self.rank}: {type(err).__name__}: {err}")

    def tick(self) -> None:
        now = time.monotonic()
        try:
            self.beat()
            verdict = self.verdict_from_rank0()
            dead, silent = self.look(now)
        except (RuntimeError, OSError) as err:  # DistStoreError: a timeout, a refused or reset connection
            if 0 in self.finished and self.rank != 0:  # rank 0 said it was done; its store may go with it
                self.stopping.set()
            elif now - self.last_ok > self.settings.dead_after:
                self.end(f"the rendezvous store has not answered for {now - self.last_ok:.0f} s ({_first_line(err)})")
            return
        self.last_ok = now
        if verdict:
            self.end(f"rank 0 found {verdict[0]}", verdict[1])
        if dead:
            self.end(dead, silent)

    def verdict_from_rank0(self) -> tuple[str, list[int]] | None:
        """Rank 0's verdict, once given: why, and the silent ranks (each rank SIGKILLs those on its own host)."""
        if self.rank == 0 or not self.store.check([_VERDICT]):
            return None
        silent, _, why = self.store.get(_VERDICT).decode(errors="replace").partition("|")
        return why, [int(r) for r in silent.split(",") if r]

    def look(self, now: float) -> tuple[str | None, list[int]]:
        """The watched ranks' beats read: a description of the dead ones (None: none) and the silent ones among them
        (dead or frozen, as opposed to ended with an error)."""
        keys = [str(r) for r in self.watched if r not in self.finished]
        present = [k for k in keys if int(k) in self.seen or self.store.check([k])]
        values = self.store.multi_get(present) if present else []
        dead, silent = [], []
        for key, raw in zip(present, values, strict=True):
            rank, value = int(key), raw.decode(errors="replace")
            status, _, doing = value.partition("|")
            if status == DONE:
                self.finished.add(rank)
                continue
            if status == FAILED:
                self.failed.add(rank)
                dead.append(f"rank {rank} ended with an error ({doing})")
                continue
            last = self.seen.get(rank)
            if last is None or last[0] != value:
                self.seen[rank] = (value, now)
            elif now - last[1] > self.settings.dead_after:
                dead.append(
                    f"rank {rank} has not beaten for {now - last[1]:.0f} s: dead or frozen (last seen: {doing})"
                )
                silent.append(rank)
        return "; ".join(dead) or None, silent

    def end(self, why: str, silent: list[int] = ()) -> None:
        """Report, leave the verdict for the others (rank 0) and this rank's own end in the store, SIGKILL the
        `silent` ranks that run on this machine (local_process.py: a frozen one holds torchrun's teardown 30 s), and
        exit."""
        self.stopping.set()
        doing = phase.describe()
        _write_line(
            f"[optimum-parallel] heartbeat on rank {self.rank}: {why}. This rank: {doing}. Ending this process "
            f"(exit code {EXIT_CODE}) so that the launcher ends the job."
        )
        try:
            if self.rank == 0:
                self.store.set(_VERDICT, f"{','.join(map(str, silent))}|{why}")
            self.store.set(str(self.rank), f"{FAILED}|ended by its heartbeat: {why}"[:2000])
            if self.rank == 0 and self.world > 1:
                time.sleep(self.settings.interval + 0.5)  # the others read the verdict at their next beat
            for rank in silent:
                if local_process.kill_if_here(self.store.get(f"process/{rank}").decode()):
                    _write_line(
                        f"[optimum-parallel] heartbeat on rank {self.rank}: SIGKILLed rank {rank} (on this machine)"
                    )
        except (RuntimeError, OSError):
            pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        os._exit(EXIT_CODE)

    def stop(self, status: str, detail: str = "") -> None:
        """Stop beating and say why in this rank's key (`DONE` or `FAILED`), once, after any beat in flight."""
        with self.writing:
            if self.stopping.is_set():
                return
            self.stopping.set()
            try:
                self.store.set(str(self.rank), f"{status}|{detail}"[:2000])
            except (RuntimeError, OSError):
                pass

    def peers_in_trouble(self) -> bool:
        """Whether a watched rank failed or missed two beats, as last seen (the exit hook then skips anything that
        waits on peers)."""
        now = time.monotonic()
        late = 2 * self.settings.interval + _STORE_OP_S
        silent = any(now - changed > late for rank, (_, changed) in self.seen.items() if rank not in self.finished)
        return silent or bool(self.failed)


_CURRENT: list[_Heartbeat] = []  # this process's heartbeat, if one runs
_ENDING = threading.Event()  # an uncaught exception is being reported: this process ends on its own


def start(settings: HeartbeatSettings) -> bool:
    """Start this rank's heartbeat on the default group's store (once per group; a later call changes its settings).
    Nothing (False) with the heartbeat off, one process, or a store that cannot open a second connection."""
    if not settings.on or not dist.is_initialized() or dist.get_world_size() < 2:
        return False
    running = current()
    if running is not None and running.group is dist.distributed_c10d._get_default_group():
        running.settings = settings
        return True
    if running is not None:  # the group it watched was replaced: its store may be gone with it, so no last word
        running.stopping.set()
    try:
        heartbeat = _Heartbeat(settings)
    except (AttributeError, NotImplementedError, RuntimeError):  # a store without clone(): no heartbeat
        return False
    if not _CURRENT:  # the first one: the hooks, once per process
        _watch_uncaught_exceptions()
        atexit.register(_at_exit)
    _CURRENT[:] = [heartbeat]
    phase.count_steps()
    return True


def current() -> _Heartbeat | None:
    """The running heartbeat (None when none runs or it stopped)."""
    return _CURRENT[0] if _CURRENT and not _CURRENT[0].stopping.is_set() else None


def peers_in_trouble() -> bool:
    """Whether the heartbeat last saw a peer fail or miss beats (False without a heartbeat)."""
    return bool(_CURRENT) and _CURRENT[0].peers_in_trouble()


def _watch_uncaught_exceptions() -> None:
    """Flag an uncaught exception before any other hook reports it (hang_report's waits for its peers' reports):
    from then on this process ends on its own, and the watcher must not end it first."""
    previous = sys.excepthook

    def hook(kind, error, trace) -> None:
        mark_ending()
        previous(kind, error, trace)

    sys.excepthook = hook


def mark_ending() -> None:
    """This process reports an uncaught exception and ends on its own (hang_report's hook calls this first too)."""
    _ENDING.set()


def _at_exit() -> None:
    if not _CURRENT:
        return
    running = _CURRENT[0]  # stopped or not: its thread may still be inside a store call
    error = getattr(sys, "last_value", None)
    if error is None and not _ENDING.is_set():
        running.stop(DONE)
    else:
        running.stop(FAILED, f"{type(error).__name__}: {_first_line(error)}" if error else "an uncaught exception")
    # a daemon thread still inside a store call when Python finalizes exits as it takes the GIL back, through
    # pybind11's noexcept frames: "terminate called without an active exception", SIGABRT, a clean run failed
    if running.thread is not threading.current_thread():
        running.thread.join(_STORE_OP_S + 1.0)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


def _write_line(line: str) -> None:
    """The line and its newline in one write (the ranks share the launcher's stderr pipe: see hang_report)."""
    try:
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    except (AttributeError, OSError, ValueError):
        print(line, file=sys.stderr, flush=True)
