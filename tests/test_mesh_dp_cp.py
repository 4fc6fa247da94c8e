"""The cp mesh dim on 8 ranks (dp=2 x pp=2 x cp=2): dp and cp are not neighbours in the mesh (pp sits between), yet
their ranks form one data-parallel group, with the mesh's timeout, and every dim keeps its own groups."""

from __future__ import annotations

import torch
import torch.distributed as dist

WORLD_SIZE = 8  # worker processes of this module's `pool` (conftest.py)


def check_dp_cp_layout() -> dict:
    import optimum_parallel as op

    mesh = op.init_mesh(dp=2, pp=2, cp=2, timeout=7)
    group = mesh.data_parallel_group
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total, group=group)
    return {
        "coords": tuple(mesh.rank(d) for d in ("dp", "pp", "cp", "tp")),
        "lines": {d: mesh.ranks(d) for d in ("dp", "pp", "cp")},
        "dp_cp": dist.get_process_group_ranks(group),
        "dp_cp_mesh": mesh.data_parallel_mesh.mesh.tolist(),
        "dp_cp_rank": (mesh.data_parallel_rank, dist.get_rank(group)),
        "sum": total.item(),
        "timeout_s": group._get_backend(torch.device("cpu")).options._timeout.total_seconds(),
    }


def test_dp_x_cp_group_spans_the_pp_dim(pool):
    for rank, result in enumerate(pool.run(check_dp_cp_layout)):
        dp, pp, cp = rank // 4, rank // 2 % 2, rank % 2  # dp outermost, then pp, cp, tp innermost (tp=1)
        replicas = [d * 4 + pp * 2 + c for d in (0, 1) for c in (0, 1)]  # same pp coordinate, dp-major
        assert result["coords"] == (dp, pp, cp, 0), result
        assert result["lines"] == {
            "dp": [pp * 2 + cp, 4 + pp * 2 + cp],
            "pp": [dp * 4 + cp, dp * 4 + 2 + cp],
            "cp": [dp * 4 + pp * 2, dp * 4 + pp * 2 + 1],
        }, result
        assert result["dp_cp"] == replicas and result["dp_cp_mesh"] == replicas, result
        assert result["dp_cp_rank"] == (dp * 2 + cp, dp * 2 + cp), result
        assert result["sum"] == sum(replicas) and result["timeout_s"] == 7, result
