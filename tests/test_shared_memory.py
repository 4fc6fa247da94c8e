"""Shared-memory collectives of same-host groups (4 gloo ranks): results against gloo, chunking, order,
fallback, cleanup and timeouts."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist


def _input(rank: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=generator, dtype=dtype)


def check_collectives_match_gloo(ranks: list[int]) -> dict:
    from optimum_parallel.comm import collectives as comm
    from optimum_parallel.comm.shared_memory import CAPACITY, shared_memory_group

    group = dist.new_group(ranks)
    groups = {tuple(ranks): group}
    for other in ([0, 1], [2, 3]) if len(ranks) == 2 else ():  # every rank takes part in every new_group
        if tuple(other) != tuple(ranks):
            groups[tuple(other)] = dist.new_group(other)
    rank = dist.get_rank()
    if rank not in ranks:
        return {}
    members = dist.get_process_group_ranks(group)
    mismatches = []
    shapes = [(3, 5), (CAPACITY // 4 * 5 // 2,)]  # small, and 2.5 slots of float32 (chunked)
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for shape in shapes:
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
                ours = comm.all_reduce(_input(rank, shape, dtype), group, op=op)
                inputs = [_input(r, shape, dtype) for r in members]
                expected = inputs[0].clone()
                for other in inputs[1:]:
                    expected = expected + other if op == dist.ReduceOp.SUM else torch.maximum(expected, other)
                reference = _input(rank, shape, dtype)
                dist.all_reduce(reference, op=op, group=group)
                if not torch.equal(ours, expected):  # rank-order reduction: the same bits on every rank
                    mismatches.append(("all_reduce", str(dtype), shape, str(op)))
                tolerance = {torch.float32: 1e-5, torch.bfloat16: 5e-2}.get(dtype, 0)  # gloo sums in another order
                if not torch.allclose(ours.double(), reference.double(), rtol=tolerance, atol=tolerance):
                    mismatches.append(("against gloo", str(dtype), shape, str(op)))
    x = _input(rank, (2, 6, 3), torch.float32, seed=1)
    gathered = comm.all_gather(x, 1, group)
    expected = torch.cat([_input(r, (2, 6, 3), torch.float32, seed=1) for r in members], dim=1)
    if not torch.equal(gathered, expected):
        mismatches.append(("all_gather",))
    x = _input(rank, (2, 4 * len(members), 3), torch.float32, seed=2)
    scattered, work = comm.start_reduce_scatter(x, 1, group)
    work.wait()
    total = sum(_input(r, x.shape, torch.float32, seed=2) for r in members)
    if not torch.allclose(scattered, total.chunk(len(members), dim=1)[members.index(rank)], atol=1e-6):
        mismatches.append(("reduce_scatter",))
    return {"shared": shared_memory_group(group, x) is not None, "mismatches": mismatches}


@pytest.mark.parametrize("ranks", [[0, 1, 2, 3], [0, 1], [2, 3]])
def test_collectives_match_gloo(pool, ranks):
    results = pool.run(check_collectives_match_gloo, ranks)
    for rank in ranks:
        assert results[rank] == {"shared": True, "mismatches": []}


def check_async_in_order() -> list[bool]:
    """Two started all-reduces waited on in reverse order, then 50 more: slot sets are reused correctly; an op
    shared memory does not reduce goes through gloo."""
    from optimum_parallel.comm import collectives as comm

    group = dist.new_group([0, 1, 2, 3])
    rank, ok = dist.get_rank(), []
    first, work_first = comm.start_all_reduce(torch.full((1000,), float(rank)), group)
    second, work_second = comm.start_all_reduce(torch.full((1000,), 10.0 * rank), group)
    work_second.wait()
    work_first.wait()
    ok += [torch.equal(first, torch.full((1000,), 6.0)), torch.equal(second, torch.full((1000,), 60.0))]
    for step in range(50):
        x, work = comm.start_all_reduce(torch.full((257,), float(rank + step)), group)
        torch.randn(64, 64) @ torch.randn(64, 64)  # compute while it is in flight
        work.wait()
        ok.append(torch.equal(x, torch.full((257,), float(6 + 4 * step))))
    product = comm.all_reduce(torch.full((3,), rank + 1.0), group, op=dist.ReduceOp.PRODUCT)  # through gloo
    ok.append(torch.equal(product, torch.full((3,), 24.0)))
    return ok


def test_async_collectives_finish_in_order(pool):
    for ok in pool.run(check_async_in_order):
        assert all(ok)


def check_cleanup_and_switch() -> dict:
    from optimum_parallel.comm import collectives as comm
    from optimum_parallel.comm.shared_memory import shared_memory_group

    on = dist.new_group([0, 1, 2, 3])
    comm.all_reduce(torch.ones(4), on)
    dist.barrier()
    leftovers = [name for name in os.listdir("/dev/shm") if name.startswith("optimum_parallel_")]
    os.environ["OPTIMUM_PARALLEL_SHM"] = "0"
    try:
        off = dist.new_group([0, 1, 2, 3])
        reduced = comm.all_reduce(torch.ones(4), off)
    finally:
        del os.environ["OPTIMUM_PARALLEL_SHM"]
    return {
        "on": shared_memory_group(on, reduced) is not None,
        "off": shared_memory_group(off, reduced) is not None,
        "reduced": reduced.tolist(),
        "leftovers": leftovers,
    }


def test_files_are_unlinked_and_env_turns_it_off(pool):
    for result in pool.run(check_cleanup_and_switch):
        assert result == {"on": True, "off": False, "reduced": [4.0] * 4, "leftovers": []}


def check_timeout() -> str:
    from optimum_parallel.comm import collectives as comm

    group = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    if dist.get_rank() > 1:
        return ""
    comm.all_reduce(torch.ones(8), group)  # both ranks: the group connects
    if dist.get_rank() == 1:
        return ""  # rank 1 never comes to the second one
    try:
        comm.all_reduce(torch.ones(8), group)
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_missing_rank_times_out(pool):
    message = pool.run(check_timeout)[0]
    assert "timed out after 2 s waiting for rank 1" in message


def check_tp_mesh_uses_shared_memory() -> bool:
    import optimum_parallel as op
    from optimum_parallel.comm import collectives as comm
    from optimum_parallel.comm.shared_memory import shared_memory_group

    mesh = op.init_mesh(dp=2, tp=2)
    group = mesh.group("tp")
    comm.all_reduce(torch.ones(2), group)
    return shared_memory_group(group, torch.ones(2)) is not None


def test_tp_groups_of_a_mesh_use_shared_memory(pool):
    assert all(pool.run(check_tp_mesh_uses_shared_memory))
