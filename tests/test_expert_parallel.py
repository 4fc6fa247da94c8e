"""Expert parallelism (ep): the mesh's expert groups, and the experts of a mixture-of-experts model split over the
dp ranks, tokens dispatched by all-to-all, against one process on the global batch (gloo, 4 ranks)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

WORLD_SIZE = 4


def check_expert_mesh() -> dict:
    import optimum_parallel as op

    out = {}
    for name, sizes in {
        "dp4_ep2": dict(dp=4, ep=2),
        "dp2_tp2_ep2": dict(dp=2, tp=2, ep=2),
        "dp2_cp2_ep4": dict(dp=2, cp=2, ep=4),
    }.items():
        mesh = op.init_mesh(**sizes)
        out[name] = {
            "ep": (mesh.size("ep"), mesh.rank("ep")),
            "expert_group": dist.get_process_group_ranks(mesh.group("ep")),
            "replicas": dist.get_process_group_ranks(mesh.expert_replica_group),
        }
    plain = op.init_mesh(dp=4)
    out["plain_ep"] = plain.size("ep")
    errors = []
    for bad in (3, 8, 0, True, "2"):
        try:
            op.init_mesh(dp=4, ep=bad)
        except ValueError as err:
            errors.append(str(err))
    out["errors"] = errors
    out["unchanged"] = op.get_mesh() is plain  # a refused request leaves the current mesh alone
    try:
        _ = plain.expert_group
    except ValueError as err:
        out["no_ep"] = str(err)
    return out


def test_expert_mesh_groups_and_errors(pool):
    for rank, result in enumerate(pool.run(check_expert_mesh)):
        assert result["dp4_ep2"] == {
            "ep": (2, rank % 2),
            "expert_group": [0, 1] if rank < 2 else [2, 3],
            "replicas": [0, 2] if rank % 2 == 0 else [1, 3],
        }
        # grid [dp, pp, cp, tp]: rank = 2 * dp + tp; an expert group is the dp ranks of one tp coordinate
        group = [rank % 2, rank % 2 + 2]
        assert result["dp2_tp2_ep2"] == {"ep": (2, rank // 2), "expert_group": group, "replicas": [rank]}
        assert result["dp2_cp2_ep4"] == {"ep": (4, rank), "expert_group": [0, 1, 2, 3], "replicas": [rank]}
        assert result["plain_ep"] == 1
        assert len(result["errors"]) == 5
        for message in result["errors"]:
            assert "ep=" in message and "allowed: 1, 2, 4" in message, message
        assert result["unchanged"]
        assert "ep=1" in result["no_ep"] and "allowed" in result["no_ep"]


@pytest.mark.parametrize("bad", [4, 0])
def test_expert_parallel_size_check_alone(bad):
    from optimum_parallel.mesh.parallel_mesh import check_expert_parallel_size

    with pytest.raises(ValueError, match=r"ep=.*allowed: 1, 2, 3, 6"):
        check_expert_parallel_size(bad, 3, 2)
