"""A stand-in for ParallelMesh where only sizes matter (resolving and checking plans on one process)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SimulatedMesh:
    """Sizes of a dp x pp x cp x tp mesh, and the tp rank a plan is being resolved for; no process groups."""

    tp_size: int
    tp_rank: int = 0
    sizes: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sizes = {"dp": 1, "pp": 1, "cp": 1, "tp": self.tp_size, **self.sizes}

    def size(self, dim: str) -> int:
        if dim == "ep":  # expert parallelism: not a dim of the grid, 1 unless given
            return self.sizes.get("ep", 1)
        return self.sizes["tp" if dim == "mp" else dim]

    def rank(self, dim: str) -> int:
        return self.tp_rank if dim in ("tp", "mp") else 0
