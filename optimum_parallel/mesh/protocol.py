"""`ParallelMesh`: what every package of the library asks of the process grid, whatever builds it (a torch DeviceMesh,
torch-xla's replica groups, or sizes alone for planning on one process).

Dims are the grid's (`layout.GRID_DIMS`: dp, pp, cp, tp; `mp` is tp) and the derived ones: `dp_cp` (the ranks
holding the same parameters), `ep` (the data-parallel ranks that split the experts between them) and `ep_replicate`
(those holding the same experts). Every size and rank list follows from `layout`; an implementation makes the groups.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import timedelta

import torch.distributed as dist

from .layout import MeshLayout

NO_EXPERT_PARALLELISM = "this mesh has no expert parallelism (ep=1); allowed: init_mesh(..., ep=N), N dividing dp x cp"


class ParallelMesh(ABC):
    """The dp x pp x cp x tp grid (and ep over dp x cp): sizes, this rank's coordinates, its groups (each with the
    mesh's timeout). Implementations make the groups and sub-meshes; everything else is derived here."""

    layout: MeshLayout
    timeout: timedelta
    device_type: str

    @abstractmethod
    def rank(self, dim: str) -> int:
        """This rank's coordinate along `dim`."""

    @abstractmethod
    def group(self, dim: str) -> dist.ProcessGroup:
        """This rank's group along `dim`."""

    @abstractmethod
    def ranks(self, dim: str) -> list[int]:
        """Global ranks of this rank's group along `dim`, in group-rank order."""

    @abstractmethod
    def subgroups(self, dim: str, parts: int) -> dist.ProcessGroup:
        """Every group along `dim` cut into `parts` contiguous blocks: this rank's block's group (e.g. the tp ranks
        holding the same replicated kv head)."""

    @abstractmethod
    def group_of(self, dim: str, positions) -> dist.ProcessGroup | None:
        """The group of the ranks at `positions` along `dim` (in every line); None if this rank is not among them."""

    @property
    @abstractmethod
    def data_parallel_group(self) -> dist.ProcessGroup:
        """The group gradients are averaged over (DDP, ZeRO-1, the pipeline): dp x cp."""

    @property
    @abstractmethod
    def data_parallel_mesh(self):
        """`data_parallel_group` as a 1-D torch DeviceMesh (FSDP2 shards over it)."""

    @abstractmethod
    def sharding_mesh(self, shard_size: int = -1):
        """The mesh FSDP2 shards over: 1-D, or 2-D (replicate, shard) for hybrid sharding."""

    @abstractmethod
    def sharding_group(self, shard_size: int = -1) -> dist.ProcessGroup:
        """This rank's sharding group (ZeRO-1's and FSDP2's): `shard_size` ranks of dp x cp; -1: all of them."""

    @property
    @abstractmethod
    def expert_replica_mesh(self):
        """`expert_replica_group` as a 1-D DeviceMesh (FSDP2 shards the experts over it)."""

    # ------------------------------------------------------------------ derived from the layout and the above

    @property
    def sizes(self) -> dict[str, int]:
        """The grid dims' sizes, outermost first."""
        return dict(self.layout.sizes)

    def size(self, dim: str) -> int:
        return self.layout.size(dim)

    @property
    def tp_size(self) -> int:
        return self.size("tp")

    @property
    def tp_rank(self) -> int:
        return self.rank("tp")

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.group("tp")

    @property
    def data_parallel_size(self) -> int:
        """Ranks holding the same parameters: dp x cp."""
        return self.layout.data_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        """This rank's place in `data_parallel_group` (dp-major, as torch flattens dp x cp)."""
        return self.layout.data_parallel_rank({dim: self.rank(dim) for dim in self.layout.sizes})

    @property
    def expert_group(self) -> dist.ProcessGroup:
        """The ep ranks (consecutive in dp x cp) whose experts together are all of them: tokens are dispatched
        among them."""
        return self.group("ep")

    @property
    def expert_replica_group(self) -> dist.ProcessGroup:
        """The dp x cp / ep ranks holding the same experts: expert gradients are averaged over them."""
        return self.group("ep_replicate")
