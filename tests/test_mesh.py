"""init_mesh / set_mesh / get_mesh: sizes, aliases, the cp dim, errors and process-group timeouts (gloo, 2 ranks)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

WORLD_SIZE = 2  # worker processes of this module's `pool` (conftest.py)


def check_mesh_shapes() -> dict:
    import sys

    import optimum_parallel as op
    from optimum_parallel.mesh import ranks

    default = op.init_mesh()  # tp takes the whole world
    alias = op.init_mesh(dp=1, mp=2)
    data = op.init_mesh(dp=2, tp=1)
    return {
        "default_tp": default.tp_size,
        "alias_tp": alias.tp_size,
        "current_is_last": op.get_mesh() is data,
        "dp_ranks": data.ranks("dp"),
        "tp_rank": alias.tp_rank,
        # the one rank accessor is torch.distributed's off XLA, and asks nothing of torch-xla
        "accessor": (ranks.global_rank(), ranks.rank(alias.tp_group), ranks.world_size(), ranks.on_xla()),
        "torch_xla_loaded": "torch_xla" in sys.modules,
    }


def test_mesh_shapes_and_alias(pool):
    for rank, result in enumerate(pool.run(check_mesh_shapes)):
        assert result == {
            "default_tp": 2,
            "alias_tp": 2,
            "current_is_last": True,
            "dp_ranks": [0, 1],
            "tp_rank": rank,
            "accessor": (rank, rank, 2, False),
            "torch_xla_loaded": False,
        }


def check_cp_mesh() -> dict:
    """cp=2 on 2 ranks: tp defaults to 1; the dp x cp data-parallel group is the cp group (dp=1); with cp=1 the
    data-parallel group and mesh are dp's, unchanged."""
    import optimum_parallel as op

    mesh = op.init_mesh(cp=2)
    plain = op.init_mesh(dp=2)
    return {
        "sizes": mesh.sizes,
        "cp_ranks": mesh.ranks("cp"),
        "cp_rank": mesh.rank("cp"),
        "dp_cp_ranks": dist.get_process_group_ranks(mesh.data_parallel_group),
        "dp_cp_mesh": mesh.data_parallel_mesh.mesh.tolist(),
        "dp_cp_size_rank": (mesh.data_parallel_size, mesh.data_parallel_rank),
        "plain_group_is_dp": plain.data_parallel_group is plain.group("dp"),
        "plain_mesh": plain.data_parallel_mesh.mesh.tolist(),
    }


def test_cp_dim(pool):
    for rank, result in enumerate(pool.run(check_cp_mesh)):
        assert result == {
            "sizes": {"dp": 1, "pp": 1, "cp": 2, "tp": 1},
            "cp_ranks": [0, 1],
            "cp_rank": rank,
            "dp_cp_ranks": [0, 1],
            "dp_cp_mesh": [0, 1],
            "dp_cp_size_rank": (2, rank),
            "plain_group_is_dp": True,
            "plain_mesh": [0, 1],
        }


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
        ({"sp": 2}, ["'sp'", "dp, pp, cp, tp, mp"]),
        ({"cp": 2, "tp": 2}, ["dp=1 x pp=1 x cp=2 x tp=2 = 4 ranks", "world size is 2"]),
        ({"cp": 0}, ["cp=0", "positive"]),
        ({"tp": 2, "mp": 1}, ["tp=2", "mp=1", "disagree"]),
        ({"tp": 2, "device": "tpu"}, ["device='tpu'", "available here: cpu"]),
    ],
)
def test_mesh_errors_name_the_value(pool, kwargs, words):
    for message in pool.run(check_mesh_error, kwargs):
        assert all(w in message for w in words), message


def test_get_mesh_without_init_says_what_to_do():
    import optimum_parallel.mesh.init as mesh
    from optimum_parallel.mesh.layout import canonical_dim

    saved, mesh._CURRENT_MESH = mesh._CURRENT_MESH, None
    try:
        with pytest.raises(RuntimeError, match="init_mesh"):
            mesh.get_mesh()
        with pytest.raises(ValueError, match="unknown mesh dim 'sp'"):
            canonical_dim("sp")
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
