"""The device the accelerator lane runs on, and a pool of worker processes on it, started once per test module.

`OP_TEST_DEVICE` names the device (default: the simulated `neuron`, simulated_neuron.py, installed in every process
before anything touches a device); `OP_TEST_BACKEND` re-registers the device's process-group backend (gloo: two
processes sharing one CUDA GPU, which NCCL refuses); `OP_TEST_PG_TIMEOUT_S` the workers' process-group timeout
(default 60; a hung case is given up after twice that). The workers start torch.distributed as a user's script does
under torchrun (LOCAL_RANK=rank, no device set, no backend named: the device's registered one), and `init_mesh` then
picks each one's device: index 0 for both on a one-device machine (test_device_index.py); or, with
`own_group=False`, leave the default group to `init_mesh` (which binds it to the device: test_bound_group.py).

`Collectives` counts the collectives that ran: the simulated device's own counter on `neuron`, elsewhere a dispatch
mode that sees every c10d op (forward and backward).
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from datetime import timedelta

import simulated_neuron
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from optimum_parallel.mesh.ports import free_port

DEVICE = os.environ.get("OP_TEST_DEVICE", simulated_neuron.NAME)
SIMULATED = DEVICE == simulated_neuron.NAME
BACKEND_OVERRIDE = os.environ.get("OP_TEST_BACKEND") or None
PG_TIMEOUT = timedelta(seconds=float(os.environ.get("OP_TEST_PG_TIMEOUT_S", "60")))
HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)


def install() -> None:
    """Make the lane's device usable in this process (the simulated one installed; the backend re-registered)."""
    if SIMULATED:
        simulated_neuron.install()
    if BACKEND_OVERRIDE:
        dist.Backend.default_device_backend_map[DEVICE] = BACKEND_OVERRIDE


def registered_backend() -> str:
    """The process-group backend registered for the lane's device (neuron_gloo for the simulated neuron)."""
    return dist.get_default_backend_for_device(DEVICE)


class _CountC10d(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.count += 1
        return func(*args, **(kwargs or {}))


class Collectives:
    """`with Collectives() as c: ...`; then `c.count`: how many collectives ran on the device inside."""

    def __enter__(self) -> Collectives:
        self.count = 0
        if SIMULATED:
            simulated_neuron.reset_counters()
        else:
            self._mode = _CountC10d().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if SIMULATED:
            self.count = simulated_neuron.counters().get("collectives", 0)
        else:
            self._mode.__exit__(*exc)
            self.count = self._mode.count


# ---- the pool -------------------------------------------------------------------------------------------------
def _worker(rank: int, world_size: int, port: int, setup, own_group: bool, tasks, results) -> None:
    setup()  # first: no device tensor may exist before it
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    if own_group:
        dist.init_process_group(timeout=PG_TIMEOUT)  # no backend named: the device's registered one
    while (task := tasks.get()) is not None:
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    if dist.is_initialized():
        dist.destroy_process_group()


def forkserver_context():
    """A forkserver that imported torch, transformers, the package's heavy modules and the test helpers once (not the
    device: each worker installs it). The forkserver ignores the parent's sys.path: both test directories go in
    PYTHONPATH."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([HERE, TESTS, *(p for p in paths if p not in (HERE, TESTS))])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "simulated_neuron", "_preload", "_models", "_checks"])
    return ctx


class Workers:
    """`world_size` processes on the lane's device (`setup`: what makes it usable, first thing in each process);
    `run(fn, *args)` runs `fn` on every rank and returns the ranks' results (a failure on any rank raises with every
    failing rank's traceback, and the pool restarts). `own_group=False`: the workers make no default group."""

    def __init__(
        self,
        world_size: int,
        setup=install,
        task_timeout_s: float = 2 * PG_TIMEOUT.total_seconds(),
        own_group: bool = True,
    ) -> None:
        self.world_size, self.setup, self.task_timeout_s = world_size, setup, task_timeout_s
        self.own_group = own_group
        self._start()

    def _start(self) -> None:
        ctx = forkserver_context()
        port = free_port()
        self.tasks, self.results = [ctx.Queue() for _ in range(self.world_size)], ctx.Queue()
        args = [
            (r, self.world_size, port, self.setup, self.own_group, self.tasks[r], self.results)
            for r in range(self.world_size)
        ]
        self.procs = [ctx.Process(target=_worker, args=a, daemon=True) for a in args]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, **kwargs) -> list:
        for q in self.tasks:
            q.put((fn, args, kwargs))
        outcome, deadline = {}, time.monotonic() + self.task_timeout_s
        while len(outcome) < self.world_size:
            try:
                rank, ok, value = self.results.get(timeout=2)
            except queue.Empty:
                dead = {r: p.exitcode for r, p in enumerate(self.procs) if not p.is_alive()}
                if dead or time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(outcome))
                    self.restart()
                    raise RuntimeError(f"{fn.__name__}: ranks {missing} gave no result (exited: {dead})") from None
                continue
            outcome[rank] = (ok, value)
        failed = {r: v for r, (ok, v) in outcome.items() if not ok}
        if failed:
            self.restart()
            details = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))
            raise AssertionError(f"{fn.__name__} failed on ranks {sorted(failed)}:\n{details}")
        return [outcome[r][1] for r in range(self.world_size)]

    def restart(self) -> None:
        self.close()
        self._start()

    def close(self) -> None:
        for q in self.tasks:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
