"""init_mesh / set_mesh / get_mesh: sizes, aliases, errors and process-group timeouts (gloo, 2 ranks)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

WORLD_SIZE = 2  # worker processes of this module's `pool` (conftest.py)


def check_mesh_shapes() -> dict:
    import optimum_parallel as op

    default = op.init_mesh()  # tp takes the whole world
    alias = op.init_mesh(dp=1, mp=2)
    data = op.init_mesh(dp=2, tp=1)
    return {
        "default_tp": default.tp_size,
        "alias_tp": alias.tp_size,
        "current_is_last": op.get_mesh() is data,
        "dp_ranks": data.ranks("dp"),
        "tp_rank": alias.tp_rank,
    }


def test_mesh_shapes_and_alias(pool):
    for rank, result in enumerate(pool.run(check_mesh_shapes)):
        assert result == {"default_tp": 2, "alias_tp": 2, "current_is_last": True, "dp_ranks": [0, 1], "tp_rank": rank}


def check_mesh_error(kwargs: dict) -> str:
    import optimum_parallel as op

    try:
        op.init_mesh(**kwargs)
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(
    "kwargs,words",
    [
        ({"dp": 2, "tp": 2}, ["dp=2", "tp=2", "= 4 ranks", "world size is 2"]),
        ({"dp": 0, "tp": 2}, ["dp=0", "positive"]),
        ({"tp": -2}, ["tp=-2", "positive"]),
        ({"cp": 2}, ["'cp'", "dp, pp, tp, mp"]),
        ({"tp": 2, "mp": 1}, ["tp=2", "mp=1", "disagree"]),
    ],
)
def test_mesh_errors_name_the_value(pool, kwargs, words):
    for message in pool.run(check_mesh_error, kwargs):
        assert all(w in message for w in words), message


def test_get_mesh_without_init_says_what_to_do():
    import optimum_parallel.mesh.parallel_mesh as mesh

    saved, mesh._CURRENT_MESH = mesh._CURRENT_MESH, None
    try:
        with pytest.raises(RuntimeError, match="init_mesh"):
            mesh.get_mesh()
        with pytest.raises(ValueError, match="unknown mesh dim 'sp'"):
            mesh._canonical_dim("sp")
    finally:
        mesh._CURRENT_MESH = saved


def check_timeout() -> tuple[bool, float]:
    """Rank 1 never joins the all-reduce: rank 0 must fail after the mesh's 3 s timeout, not hang."""
    import optimum_parallel as op

    mesh = op.init_mesh(tp=2, timeout=3)
    if dist.get_rank() == 1:
        time.sleep(5)
        return True, 0.0
    start = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(1), group=mesh.tp_group)
    except RuntimeError:
        return True, time.perf_counter() - start
    return False, time.perf_counter() - start


def test_process_groups_time_out(pool):
    failed, seconds = pool.run(check_timeout)[0]
    assert failed and 2.5 <= seconds <= 10, seconds
