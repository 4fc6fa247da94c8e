"""A mesh where only sizes matter (resolving and checking plans on one process): the layout, one chosen tp rank,
no process groups."""

from __future__ import annotations

from datetime import timedelta

from .layout import MeshLayout, canonical_dim
from .protocol import ParallelMesh


class SimulatedMesh(ParallelMesh):
    """Sizes of a dp x pp x cp x tp mesh (and ep), and the tp rank a plan is being resolved for."""

    device_type = "meta"
    timeout = timedelta(0)

    def __init__(self, tp_size: int, tp_rank: int = 0, sizes: dict[str, int] | None = None) -> None:
        sizes = {**(sizes or {}), "tp": tp_size}
        ep = sizes.pop("ep", 1)
        self.layout = MeshLayout(sizes, ep)
        self._tp_rank = tp_rank

    def rank(self, dim: str) -> int:
        return self._tp_rank if canonical_dim(dim) == "tp" else 0

    def group(self, dim: str):
        raise RuntimeError(f"a simulated mesh has no process groups (asked for {dim!r}'s)")

    def ranks(self, dim: str) -> list[int]:
        return self.layout.lines(dim)[0]

    def subgroups(self, dim: str, parts: int):
        return self.group(dim)

    def group_of(self, dim: str, positions):
        return self.group(dim)

    @property
    def data_parallel_group(self):
        return self.group("dp_cp")

    @property
    def data_parallel_mesh(self):
        return self.group("dp_cp")

    @property
    def expert_replica_mesh(self):
        return self.group("ep_replicate")

    def sharding_mesh(self, shard_size: int = -1):
        return self.group("dp_cp")

    def sharding_group(self, shard_size: int = -1):
        return self.group("dp_cp")
