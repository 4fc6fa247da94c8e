"""`init_mesh` making the default group itself on the lane's device, as a user's script under torchrun does with
nothing but `op.init_mesh(tp=2)`: the group is bound to the device (`device_id`), and torch then splits every later
group from the bound backend. The simulated device's backend wraps gloo, which reports splitting but cannot do it for
a rank outside the new group ("'ProcessGroupGloo' object has no attribute 'perform_nocolor_split'" on every rank,
before the fix): the binding is kept only where the split works (mesh/binding.py)."""

from __future__ import annotations

import types

import pytest
import torch
from _accel import DEVICE, PG_TIMEOUT, SIMULATED, Workers, install, registered_backend

install()  # this process too: the device's registered backend is read here


def _init_mesh_itself() -> dict:
    import torch.distributed as dist

    import optimum_parallel as op
    from optimum_parallel.mesh import device as devices

    made_before = dist.is_initialized()
    mesh = op.init_mesh(tp=2, timeout=PG_TIMEOUT)
    out = {"made_before": made_before, "backend": dist.get_backend(), "sums": {}}
    for dim in ("tp", "dp"):  # a group of both ranks, and one of each rank alone (the other rank outside it)
        x = torch.ones(2, device=devices.collective_device(mesh.group(dim)))
        dist.all_reduce(x, group=mesh.group(dim))
        out["sums"][dim] = x.cpu().tolist()
    alone = dist.new_group([0], timeout=PG_TIMEOUT)  # after the mesh too: rank 1 is outside it
    out["outside"] = alone is dist.GroupMember.NON_GROUP_MEMBER
    bound = getattr(dist.group.WORLD, "bound_device_id", None)
    out["bound"] = None if bound is None else str(bound)
    return out


def test_init_mesh_makes_a_group_on_the_device_that_every_later_group_can_come_from():
    workers = Workers(2, own_group=False)
    try:
        results = workers.run(_init_mesh_itself)
    finally:
        workers.close()
    for rank, r in enumerate(results):
        assert not r["made_before"] and r["backend"] == registered_backend(), r
        assert r["sums"] == {"tp": [2.0, 2.0], "dp": [1.0, 1.0]}, r
        assert r["outside"] == (rank == 1), r
        if SIMULATED:  # gloo underneath: no split, so no binding
            assert r["bound"] is None, r


class _Backend:
    def __init__(self, splits: bool, nocolor: bool, wrapped=None) -> None:
        self.supports_splitting = splits
        if nocolor:
            self.perform_nocolor_split = lambda device: None
        if wrapped is not None:
            self.wrapped_pg = wrapped


def _group(backend) -> types.SimpleNamespace:
    return types.SimpleNamespace(bound_device_id=torch.device(DEVICE, 0), _get_backend=lambda device: backend)


@pytest.mark.parametrize(
    "backend, kept",
    [
        (_Backend(splits=True, nocolor=True), True),  # NCCL
        (_Backend(splits=False, nocolor=False), True),  # no split attempted: nothing to break
        (_Backend(splits=True, nocolor=False), False),  # gloo underneath
        (_Backend(splits=True, nocolor=False, wrapped=_Backend(True, True)), True),  # torch peels its wrapper
    ],
)
def test_the_binding_stays_only_where_the_backend_splits(backend, kept):
    from optimum_parallel.mesh import binding

    group = _group(backend)
    binding.keep_only_where_split_works(group)
    assert (group.bound_device_id is not None) == kept
