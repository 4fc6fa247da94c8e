"""Each attempt of a torchrun job forms its group under a prefix of its own in the agent's shared store
(optimum_parallel/mesh/rendezvous.py): attempts after one whose ranks died find the live rank 0 past the stale address
it left, and a rank that cannot reach rank 0 fails within the timeout naming TORCH_DISABLE_SHARE_RDZV_TCP_STORE, not
with a gloo connect timeout. The test process hosts the "agent's" TCPStore, as torchrun's agent does; the ranks are
real gloo processes (the full torchrun restart is in tests/test_hosts.py)."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from _pool import forkserver_context

from optimum_parallel.mesh.ports import free_port


def _env(port: int, rank: int, world: int) -> dict[str, str]:
    return {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": "1",
    }


def _attempt(port: int, rank: int, world: int, results) -> None:
    """One rank of one attempt: form the group, all-reduce, leave (a dead attempt leaves its keys behind)."""
    import torch

    from optimum_parallel.mesh import rendezvous

    os.environ.update(_env(port, rank, world))
    try:
        rendezvous.init_process_group("gloo", timedelta(seconds=30))
        value = torch.tensor([rank + 1.0])
        dist.all_reduce(value)
        results.put((rank, value.item()))
    except Exception as err:  # noqa: BLE001 - reported to the test
        results.put((rank, f"{type(err).__name__}: {err}"))
    results.close()
    results.join_thread()  # the result is in the pipe
    os._exit(0)  # no teardown: like a rank that died, it leaves its keys and its address in the agent's store


@pytest.fixture
def agent_store():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield store


def test_attempts_after_dead_ones_form_their_groups(agent_store):
    """Three attempts of 2 ranks on one shared store, each ending without a teardown: every one forms its group."""
    ctx = forkserver_context()
    for attempt in range(3):
        results = ctx.Queue()
        procs = [ctx.Process(target=_attempt, args=(agent_store.port, r, 2, results)) for r in (1, 0)]  # 1 first
        for p in procs:
            p.start()
        outcome = dict(results.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(30)
        assert outcome == {0: 3.0, 1: 3.0}, (attempt, outcome)


def test_unreachable_rank0_names_the_variable(agent_store):
    """Only a dead attempt's address is there and rank 0 never comes: rank 1 fails at the timeout, naming the fix."""
    from optimum_parallel.mesh import rendezvous

    dead = f"127.0.0.1:{free_port()}:deadtoken"  # a free port: nothing listens there
    agent_store.set("optimum_parallel/rendezvous/rank0", dead)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1") as error:
        rendezvous.attempt_store(1, 2, timedelta(seconds=3), "127.0.0.1", agent_store.port)
    assert time.monotonic() - start < 10 and "rank 0's store" in str(error.value), str(error.value)
    assert not dist.is_initialized()
