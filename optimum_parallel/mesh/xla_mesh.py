"""The grid on XLA devices (Neuron with torch-neuronx <= 2.9; torch-xla's CPU device in the tests), without a
DeviceMesh.

An XLA collective names its replica groups: all the groups of a dim at once (`[[0, 1], [2, 3]]`), given to every
group of the dim as torch-xla's `xla_pg_options` mesh. torch-xla keys collectives by those groups alone, not by
the group object, so where one process drives several devices (one thread each, torch.distributed's rank 0 on
all) each dim's one group that holds torch's rank serves every device, and `ranks.rank(group)` finds a device's
place from the lines recorded on it (`ranks.LINES_ATTR`). This rank's coordinates always come from torch-xla's
runtime (`ranks.global_rank()`), asked at each call, so one mesh object serves every thread. The lines are the
layout's (`MeshLayout.lines`), as on every mesh.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from . import device as devices
from . import ranks
from .layout import DATA_PARALLEL, EXPERT_DIM, FLATTENED, GRID_DIMS, MeshLayout, canonical_dim
from .protocol import ParallelMesh

_NO_DEVICE_MESH = (
    "{what} needs a torch DeviceMesh, which the XLA mesh does not build; allowed on XLA: sharding_level 0, "
    "shard_size -1"
)

# tried with torch-xla 2.9 on its CPU device: besides, the first receive fails (the stages' buffers are made on the CPU)
_NO_PIPELINE = (
    "pipeline stages exchange activations by send/recv, which torch-xla runs as a collective_permute plus a "
    "torch_xla.sync() per tensor: a graph cut at every stage boundary of every micro-batch, not one per step"
)
_REFUSED = {"cp": "cp=1", EXPERT_DIM: "ep=1", "pp": f"pp=1 ({_NO_PIPELINE})"}


def make_xla_groups(lines: list[list[int]], timeout) -> dist.ProcessGroup:
    """Make one group per line (every rank makes every group, as torch requires); return the one holding
    torch.distributed's rank, with every line recorded on it."""
    options = {"xla_pg_options": {"mesh": [list(line) for line in lines]}}
    made = [dist.new_group(list(line), timeout=timeout, pg_options=options) for line in lines]
    me = dist.get_rank()
    group = next(g for g, line in zip(made, lines, strict=True) if me in line)
    setattr(group, ranks.LINES_ATTR, [tuple(line) for line in lines])
    return group


@dataclass
class XlaParallelMesh(ParallelMesh):
    """A `ParallelMesh` over the "xla" backend: the same names and sizes, groups made with torch-xla's replica
    groups. Context and expert parallelism, FSDP2 and hybrid sharding are refused (they need a DeviceMesh or
    all-to-all patterns not built here), and pipeline parallelism (`_NO_PIPELINE`)."""

    layout: MeshLayout
    timeout: timedelta
    device_type: str = devices.XLA
    _groups: dict[str, dist.ProcessGroup] = field(default_factory=dict, init=False, repr=False)
    _extra_groups: dict[tuple, dist.ProcessGroup] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        for dim, allowed in _REFUSED.items():
            if self.layout.size(dim) != 1:
                size = self.layout.size(dim)
                raise ValueError(f"{dim}={size} is not supported on XLA devices yet; allowed: {allowed}")
        for dim in GRID_DIMS:
            self._groups[dim] = make_xla_groups(self.layout.lines(dim), self.timeout)
        for dim in FLATTENED:  # a grid dim's group where it holds the same ranks (cp=1: dp's), else one of its own
            lines = self.layout.lines(dim)
            same = next((g for d, g in self._groups.items() if self.layout.lines(d) == lines), None)
            self._groups[dim] = same or make_xla_groups(lines, self.timeout)

    def rank(self, dim: str) -> int:
        if canonical_dim(dim) == EXPERT_DIM:
            return 0
        return self.ranks(dim).index(ranks.global_rank())

    def group(self, dim: str) -> dist.ProcessGroup:
        dim = canonical_dim(dim)
        if dim not in self._groups:
            raise ValueError(f"{dim}: this mesh has no expert parallelism on XLA devices; allowed: ep=1")
        return self._groups[dim]

    def ranks(self, dim: str) -> list[int]:
        me = ranks.global_rank()
        return next(line for line in self.layout.lines(dim) if me in line)

    @property
    def data_parallel_mesh(self):
        raise NotImplementedError(_NO_DEVICE_MESH.format(what="FSDP2 (sharding_level 2 or 3)"))

    @property
    def data_parallel_group(self) -> dist.ProcessGroup:
        return self.group(DATA_PARALLEL)

    @property
    def expert_replica_mesh(self):
        raise NotImplementedError(_NO_DEVICE_MESH.format(what="expert parallelism"))

    def sharding_mesh(self, shard_size: int = -1):
        raise NotImplementedError(_NO_DEVICE_MESH.format(what="FSDP2 and hybrid sharding"))

    def sharding_group(self, shard_size: int = -1) -> dist.ProcessGroup:
        if shard_size not in (-1, self.data_parallel_size):
            raise NotImplementedError(_NO_DEVICE_MESH.format(what=f"shard_size={shard_size}"))
        return self.data_parallel_group

    def subgroups(self, dim: str, parts: int) -> dist.ProcessGroup:
        """Every group along `dim` cut into `parts` contiguous blocks (e.g. the tp ranks holding the same replicated
        kv head): this rank's block's group, all the blocks its XLA replica groups."""
        dim = canonical_dim(dim)
        key = (dim, parts)
        if key not in self._extra_groups:
            block = self.size(dim) // parts
            lines = [line[i : i + block] for line in self.layout.lines(dim) for i in range(0, len(line), block)]
            self._extra_groups[key] = make_xla_groups(lines, self.timeout)
        return self._extra_groups[key]

    def group_of(self, dim: str, positions) -> dist.ProcessGroup | None:
        raise NotImplementedError(
            f"a group of positions {list(positions)} along {dim} leaves ranks out of every XLA replica group; "
            "allowed on XLA: groups of whole dims or of equal blocks of them (subgroups)"
        )
