"""A pool of real torch.distributed (gloo) worker processes, started once per test module.

`pool.run(fn, *args)` runs the module-level function `fn` on every rank and returns the
per-rank results; a failure on any rank raises with every failing rank's traceback, and the
pool restarts itself so the next test starts from a clean process group.
"""

from __future__ import annotations

import os
import queue
import traceback
from datetime import timedelta

import torch.multiprocessing as mp

from optimum_parallel.mesh.ports import free_port

PG_TIMEOUT_S = 60
_TESTS = os.path.dirname(os.path.abspath(__file__))


def forkserver_context():
    """The forkserver context every test process forks from: one server imports torch, transformers and the
    package's heavy modules (`_preload`) once per test session, so a worker starts in ~0.1 s instead of importing them
    again (~5 s of CPU each on 2 cores). Python 3.11's forkserver ignores the parent's sys.path, so the tests
    directory reaches it through PYTHONPATH: without it `_preload` fails to import there, silently."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if _TESTS not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([_TESTS, *filter(None, paths)])
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "_preload", "_models", "_checks"])
    return ctx


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=PG_TIMEOUT_S))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class WorkerPool:
    def __init__(self, world_size: int, task_timeout_s: float = 240) -> None:
        self.world_size = world_size
        self.task_timeout_s = task_timeout_s
        self._start()

    def _start(self) -> None:
        ctx = forkserver_context()
        port = free_port()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, args=(r, self.world_size, port, self._tasks[r], self._results), daemon=True)
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, **kwargs) -> list:
        for q in self._tasks:
            q.put((fn, args, kwargs))
        outcome: dict[int, tuple[bool, object]] = {}
        try:
            while len(outcome) < self.world_size:
                rank, ok, value = self._results.get(timeout=self.task_timeout_s)
                outcome[rank] = (ok, value)
        except queue.Empty:
            self.restart()
            raise TimeoutError(
                f"{fn.__name__}: ranks {sorted(set(range(self.world_size)) - set(outcome))} "
                f"did not finish within {self.task_timeout_s}s"
            ) from None
        failures = {r: v for r, (ok, v) in outcome.items() if not ok}
        if failures:
            self.restart()
            details = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
            raise AssertionError(f"{fn.__name__} failed on ranks {sorted(failures)}:\n{details}")
        return [outcome[r][1] for r in range(self.world_size)]

    def restart(self) -> None:
        self.close()
        self._start()

    def close(self) -> None:
        for q in self._tasks:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
