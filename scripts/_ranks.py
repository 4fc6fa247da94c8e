"""Spawned CPU ranks for the benchmark scripts: a torchrun-style environment per rank, rank 0's result back.

    value = run_on_ranks(world, rank_main, (extra, args), deadline_s=900, what="sharding")

runs `rank_main(rank, world, extra, args)` on `world` spawned processes (one intra-op thread each,
MASTER_ADDR/PORT/RANK/WORLD_SIZE set, so `op.init_mesh()` or `dist.init_process_group()` just works) and
returns what rank 0 returned. A rank that raises, dies or runs past the deadline raises here with its
traceback; every process is joined or killed before returning.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from collections.abc import Callable
from multiprocessing.queues import Queue

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from optimum_parallel.mesh.ports import free_port


def _rank(rank: int, world: int, port: int, fn: Callable, fn_args: tuple, results: Queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    try:
        value = fn(rank, world, *fn_args)
        if rank == 0:
            results.put(("ok", rank, value))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(world: int, fn: Callable, fn_args: tuple, deadline_s: float, what: str) -> object:
    """`fn(rank, world, *fn_args)` on `world` spawned ranks; rank 0's return value (see the module docstring)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, fn, fn_args, results)) for r in range(world)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + deadline_s
    outcome = None
    try:
        while outcome is None and time.monotonic() < deadline:
            try:
                outcome = results.get(timeout=5)
            except queue.Empty:
                if any(proc.exitcode not in (None, 0) for proc in procs):
                    outcome = ("error", None, "a worker process died without a traceback")
    finally:
        for proc in procs:
            proc.join(timeout=60 if outcome and outcome[0] == "ok" else 5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if outcome is None:
        raise TimeoutError(f"{what}: the {world} workers ran past the {deadline_s:.0f} s deadline")
    status, rank, value = outcome
    if status != "ok":
        raise RuntimeError(f"{what}: rank {rank} failed:\n{value}")
    return value
