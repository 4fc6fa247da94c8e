"""The grid over torch DeviceMeshes: one process group per grid dim, the data-parallel dims and the batch-replica
dims flattened into one group each, and ep as the data-parallel ranks cut in blocks (ep_replicate, ep), every group
with the timeout of the moment (`timeouts.current()`: the init one while the mesh is made; `timeouts` changes every
group's afterwards). Which ranks each group holds is the layout's (`layout.MeshLayout.lines`); the groups come from
the process's shared set (`groups.py`), and the meshes are built on them (`DeviceMesh.from_group`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from . import device as devices
from . import hang_report, timeouts
from .groups import shared_group
from .layout import DATA_PARALLEL, EXPERT_DIM, EXPERT_REPLICA_DIM, FLATTENED, GRID_DIMS, MeshLayout, canonical_dim
from .protocol import NO_EXPERT_PARALLELISM, ParallelMesh

_GRACE = timedelta(seconds=3)  # how long a failed rank waits for the other survivors' reports (see hang_report)


@dataclass
class TorchMesh(ParallelMesh):
    """A `ParallelMesh` on a torch DeviceMesh over the device's own backend (gloo, nccl, neuron, hccl, xccl)."""

    layout: MeshLayout
    device_type: str
    timeout: timedelta
    device_mesh: DeviceMesh = field(init=False, repr=False)
    _flat_meshes: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False)
    _expert_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _sharding_meshes: dict[int, DeviceMesh] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        """Every group is made here, on every rank at once, as torch requires."""
        layout = self.layout
        shape = [layout.sizes[dim] for dim in GRID_DIMS]
        self.device_mesh = self._mesh(layout.grid.reshape(shape), [layout.lines(dim) for dim in GRID_DIMS], GRID_DIMS)
        for name, dims in FLATTENED.items():
            split = [dim for dim in dims if layout.sizes[dim] > 1]
            if len(split) > 1:  # not adjacent in the grid: one 1-D mesh over the flattened ranks, its own group
                lines = layout.lines(name)
                self._flat_meshes[name] = self._mesh(self._line_of_mine(lines), [lines], (name,))
            else:  # one dim (or none) splits: its own group
                self._flat_meshes[name] = self.device_mesh[split[0] if split else dims[0]]
        if layout.ep > 1:
            self._expert_mesh = self._blocks(layout.ep, (EXPERT_REPLICA_DIM, EXPERT_DIM))
        # a collective that fails because a rank never came says which one, on which group, and who is missing
        grace = min(max(self.timeout / 2, _GRACE), _GRACE * 3)
        hang_report.install({self.device_mesh.get_group(dim): dim for dim in GRID_DIMS}, grace)

    def _timeout(self) -> timedelta:
        return timeouts.current() or self.timeout

    def _backend(self) -> tuple[str, object]:
        backend = devices.backend_for(self.device_type)
        return backend, devices.backend_options(backend, self._timeout())

    def _group(self, ranks: list[int]) -> dist.ProcessGroup:
        """The group of `ranks` (collective: every rank calls it for every group, in the same order), made once per
        process and shared by every mesh that has it: a sweep or a test module making mesh after mesh reuses its
        groups instead of starting new worker threads for each."""
        backend, options = self._backend()
        return shared_group(ranks, backend, options, self._timeout())

    @staticmethod
    def _line_of_mine(lines: list[list[int]]) -> torch.Tensor:
        me = dist.get_rank()
        return torch.tensor(next(line for line in lines if me in line))

    def _mesh(self, mesh: torch.Tensor, lines: list[list[list[int]]], names: tuple[str, ...]) -> DeviceMesh:
        """A DeviceMesh over `mesh` (global ranks) whose dim i groups are `lines[i]` (every line made, this rank's
        kept)."""
        me, mine = dist.get_rank(), []
        for dim_lines in lines:
            groups = [(line, self._group(line)) for line in dim_lines]
            mine.append(next(group for line, group in groups if me in line))
        return DeviceMesh.from_group(mine, self.device_type, mesh=mesh, mesh_dim_names=names)

    def _blocks(self, inner: int, names: tuple[str, str]) -> DeviceMesh:
        """The data-parallel ranks as a 2-D mesh (size / inner, inner): blocks of `inner` consecutive ranks."""
        blocks, places = self.layout.block_lines(inner)
        line = self._line_of_mine(self.layout.lines(DATA_PARALLEL))
        return self._mesh(line.reshape(-1, inner), [places, blocks], names)

    def rank(self, dim: str) -> int:
        dim = canonical_dim(dim)
        if dim in GRID_DIMS:
            return self.device_mesh.get_local_rank(dim) if self.layout.sizes[dim] > 1 else 0
        if dim in FLATTENED:
            return self.layout.flat_rank(dim, {d: self.rank(d) for d in GRID_DIMS})
        place = self.data_parallel_rank
        return place % self.layout.ep if dim == EXPERT_DIM else place // self.layout.ep

    def group(self, dim: str) -> dist.ProcessGroup:
        dim = canonical_dim(dim)
        if dim in GRID_DIMS:
            return self.device_mesh.get_group(dim)
        if dim in FLATTENED:
            return self._flat_meshes[dim].get_group()
        if self._expert_mesh is None:
            raise ValueError(NO_EXPERT_PARALLELISM)
        return self._expert_mesh.get_group(dim)

    def ranks(self, dim: str) -> list[int]:
        return dist.get_process_group_ranks(self.group(dim))

    @property
    def data_parallel_group(self) -> dist.ProcessGroup:
        return self.group(DATA_PARALLEL)

    @property
    def data_parallel_mesh(self) -> DeviceMesh:
        """The 1-D mesh of the ranks holding the same parameters (dp x cp at this pp and tp coordinate), which
        FSDP2 shards over; with cp=1 it is the dp sub-mesh."""
        return self._flat_meshes[DATA_PARALLEL]

    @property
    def expert_replica_mesh(self) -> DeviceMesh:
        if self._expert_mesh is None:
            raise ValueError(NO_EXPERT_PARALLELISM)
        return self._expert_mesh[EXPERT_REPLICA_DIM]

    def sharding_mesh(self, shard_size: int = -1) -> DeviceMesh:
        """The mesh FSDP2 shards over: the 1-D `data_parallel_mesh` when `shard_size` is -1 or all dp x cp ranks;
        else the 2-D ("dp_replicate", "dp_shard") mesh of those ranks (HSDP): groups of `shard_size` consecutive
        ranks (in `data_parallel_rank` order) shard, and the ranks at the same place in every group replicate.
        Collective on every rank the first time (its groups are created, with the mesh timeout); cached."""
        size = self.layout.data_parallel_size
        if shard_size in (-1, size):
            return self._flat_meshes[DATA_PARALLEL]
        if shard_size < 1 or size % shard_size:
            raise ValueError(f"shard_size={shard_size} does not divide the dp x cp ranks ({size})")
        if shard_size not in self._sharding_meshes:
            self._sharding_meshes[shard_size] = self._blocks(shard_size, ("dp_replicate", "dp_shard"))
        return self._sharding_meshes[shard_size]

    def sharding_group(self, shard_size: int = -1) -> dist.ProcessGroup:
        """This rank's sharding group (ZeRO-1's and FSDP2's): `shard_size` ranks of dp x cp; -1: all of them."""
        mesh = self.sharding_mesh(shard_size)
        return mesh.get_group("dp_shard") if mesh.ndim == 2 else mesh.get_group()

    def subgroups(self, dim: str, parts: int) -> dist.ProcessGroup:
        """Split every group along `dim` into `parts` contiguous blocks; return this rank's block's group.

        Used e.g. for the tp ranks that hold the same replicated kv head.
        """
        size = self.size(dim)
        block = size // parts
        mine = [self.group_of(dim, range(start, start + block)) for start in range(0, size, block)]
        return next(group for group in mine if group is not None)

    def group_of(self, dim: str, positions) -> dist.ProcessGroup | None:
        """The group of the ranks at `positions` along `dim` (in every line of the mesh); None if this rank
        is not among them. Every rank takes part in creating every group (torch requires it); cached."""
        mine = None
        for line in self.layout.lines(dim):
            ranks = [line[p] for p in positions]
            group = self._group(ranks)
            if dist.get_rank() in ranks:
                mine = group
        return mine
