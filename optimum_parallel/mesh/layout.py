"""The mesh as a table of dimensions: `GRID` lists the grid dims (dp, pp, cp, tp, outermost first) and the role of each,
and `MeshLayout` derives from the table alone, without process groups, a mesh's sizes, the rank lists of every group
and every rank's coordinates (planning, checkpoints and the XLA mesh read it too). Also the names of the derived dims
(`dp_cp`, `batch`, `peers`, `ep`, `ep_replicate`) and the checks of mesh sizes. Design notes: docs/module_notes.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class MeshDim:
    name: str
    role: str  # "replica", "stage", "sequence" or "shard" (what each means: docs/module_notes.md)
    aliases: tuple[str, ...] = ()


GRID = (  # outermost to innermost: tp ranks are neighbours (fastest links), then cp (ring attention every layer)
    MeshDim("dp", "replica"),
    MeshDim("pp", "stage"),
    MeshDim("cp", "sequence"),
    MeshDim("tp", "shard", aliases=("mp",)),
)
GRID_DIMS = tuple(d.name for d in GRID)
ROLES = {d.name: d.role for d in GRID}
ALIASES = {alias: d.name for d in GRID for alias in d.aliases}
WEIGHT_REPLICA_ROLES = ("replica", "sequence")
DATA_PARALLEL_DIMS = tuple(d.name for d in GRID if d.role in WEIGHT_REPLICA_ROLES)  # ranks holding the same weights
BATCH_DIMS = tuple(d.name for d in GRID if d.role == "replica")  # ranks reading other rows of the batch
EXPERT_DIM, EXPERT_REPLICA_DIM = "ep", "ep_replicate"  # the data-parallel ranks unflattened (replicas, ep)
DATA_PARALLEL = "dp_cp"  # the name of the flattened data-parallel dims (torch's `_flatten`)
BATCH = "batch"  # the name of the flattened batch-replica dims
PEERS = "peers"  # the other dims flattened: the ranks of one batch replica, which must all be given the same batch
PEER_DIMS = tuple(d.name for d in GRID if d.role != "replica")
FLATTENED = {DATA_PARALLEL: DATA_PARALLEL_DIMS, BATCH: BATCH_DIMS, PEERS: PEER_DIMS}
DERIVED_DIMS = (DATA_PARALLEL, BATCH, PEERS, EXPERT_DIM, EXPERT_REPLICA_DIM)


def canonical_dim(dim: str, derived: bool = True) -> str:
    """`dim` with aliases resolved (mp -> tp); ValueError naming the allowed dims if the table has no such dim."""
    name = ALIASES.get(dim, dim)
    if name in GRID_DIMS or (derived and name in DERIVED_DIMS):
        return name
    allowed = ", ".join(GRID_DIMS + tuple(ALIASES) + ((EXPERT_DIM,) if derived else ()))
    raise ValueError(f"unknown mesh dim {dim!r}; allowed: {allowed}")


def check_positive_int(name: str, value: object, what: str = "it") -> int:
    """`value` if it is a positive int (not a bool); else ValueError naming `name` and the value."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} is not allowed; {what} must be a positive integer")
    return value


def check_expert_parallel_size(ep: object, replicas: int, key: str = "ep", sizes: str = "") -> int:
    """`ep` if it is a positive int dividing the `replicas` data-parallel ranks; else ValueError naming `key` and the
    allowed values (`sizes` says what they are made of, e.g. "dp x cp = 2 x 2")."""
    allowed = [d for d in range(1, replicas + 1) if replicas % d == 0]
    if isinstance(ep, bool) or not isinstance(ep, int) or ep not in allowed:
        raise ValueError(
            f"{key}={ep!r} is not allowed; expert parallelism splits the experts over ranks that share the dense "
            f"weights, so it must divide {sizes or f'the {replicas} data-parallel ranks'}; allowed: "
            f"{', '.join(map(str, allowed))}"
        )
    return ep


@dataclass(frozen=True)
class MeshLayout:
    """Sizes of every grid dim (in `GRID` order) and of ep: every group's ranks and every rank's coordinates."""

    sizes: dict[str, int]
    ep: int = 1
    grid: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sizes = {dim: self.sizes.get(dim, 1) for dim in GRID_DIMS}
        unknown = [dim for dim in self.sizes if dim not in GRID_DIMS]
        if unknown:
            canonical_dim(unknown[0], derived=False)  # raises, naming the allowed dims
        for dim, size in sizes.items():
            check_positive_int(dim, size, "a mesh size")
        object.__setattr__(self, "sizes", sizes)
        check_expert_parallel_size(self.ep, self.data_parallel_size, sizes=self.data_parallel_text)
        object.__setattr__(self, "grid", torch.arange(self.world).reshape([sizes[d] for d in GRID_DIMS]))

    @classmethod
    def for_world(cls, world: int, sizes: dict[str, int | None], ep: int = 1) -> MeshLayout:
        """The layout of `world` ranks; a dim given as None takes what the others leave (world / their product)."""
        open_dims = [dim for dim, size in sizes.items() if size is None]
        given = {dim: size for dim, size in sizes.items() if size is not None}
        for dim, size in given.items():
            check_positive_int(dim, size, "a mesh size")
        product = 1
        for size in given.values():
            product *= size
        for dim in open_dims:
            given[dim] = world // product
        layout = cls(given, ep)
        if layout.world != world:
            shape = " x ".join(f"{d}={s}" for d, s in layout.sizes.items())
            raise ValueError(f"mesh {shape} = {layout.world} ranks, but the world size is {world}")
        return layout

    @property
    def world(self) -> int:
        out = 1
        for size in self.sizes.values():
            out *= size
        return out

    def _product(self, dims: tuple[str, ...]) -> int:
        out = 1
        for dim in dims:
            out *= self.sizes[dim]
        return out

    @property
    def data_parallel_size(self) -> int:
        """Ranks holding the same parameters (the dims of `DATA_PARALLEL_DIMS`: dp x cp)."""
        return self._product(DATA_PARALLEL_DIMS)

    @property
    def data_parallel_text(self) -> str:
        """ "dp x cp = 2 x 1": what the data-parallel ranks are made of, for messages."""
        return " x ".join(DATA_PARALLEL_DIMS) + " = " + " x ".join(str(self.sizes[d]) for d in DATA_PARALLEL_DIMS)

    def size(self, dim: str) -> int:
        dim = canonical_dim(dim)
        if dim in FLATTENED:
            return self._product(FLATTENED[dim])
        if dim == EXPERT_DIM:
            return self.ep
        if dim == EXPERT_REPLICA_DIM:
            return self.data_parallel_size // self.ep
        return self.sizes[dim]

    def lines(self, dim: str) -> list[list[int]]:
        """Every group of `dim`: the global ranks that differ only in that dim's coordinate, in coordinate order.
        For the derived dims: flattened dims (outermost first, as torch flattens them), and the data-parallel ranks'
        (ep_replicate, ep) blocks."""
        dim = canonical_dim(dim)
        if dim in GRID_DIMS:
            return self.grid.movedim(GRID_DIMS.index(dim), -1).reshape(-1, self.sizes[dim]).tolist()
        if dim in FLATTENED:
            return self._flat(FLATTENED[dim]).tolist()
        inner, outer = self.block_lines(self.ep)
        return inner if dim == EXPERT_DIM else outer

    def block_lines(self, inner: int) -> tuple[list[list[int]], list[list[int]]]:
        """The data-parallel ranks of every line cut in blocks of `inner` consecutive ranks: (the blocks, and the
        ranks at one place in every block of a line): ep's (ep, ep_replicate) groups, or HSDP's (dp_shard,
        dp_replicate)."""
        flat = self._flat(DATA_PARALLEL_DIMS)
        blocks = flat.reshape(flat.shape[0], -1, inner)  # [line, block, place]
        outer = blocks.transpose(1, 2).reshape(-1, self.data_parallel_size // inner)
        return blocks.reshape(-1, inner).tolist(), outer.tolist()

    def _flat(self, dims: tuple[str, ...]) -> torch.Tensor:
        inner = [GRID_DIMS.index(d) for d in dims]
        outer = [i for i in range(len(GRID_DIMS)) if i not in inner]
        return self.grid.permute(*outer, *inner).reshape(-1, self._product(dims))

    def coordinates(self, rank: int) -> dict[str, int]:
        """`rank`'s coordinate along every grid dim."""
        where = (self.grid == rank).nonzero()[0].tolist()
        return dict(zip(GRID_DIMS, where, strict=True))

    def flat_rank(self, dim: str, coordinates: dict[str, int]) -> int:
        """The place along the flattened `dim` (outermost dim first, as torch flattens them) of these coordinates."""
        place = 0
        for inner in FLATTENED[canonical_dim(dim)]:
            place = place * self.sizes[inner] + coordinates[inner]
        return place

    def data_parallel_rank(self, coordinates: dict[str, int]) -> int:
        """The place among the data-parallel ranks of these coordinates."""
        return self.flat_rank(DATA_PARALLEL, coordinates)

    def weight_shards(self) -> dict[str, int]:
        """The sizes a checkpoint records: the dims that cut the weights (pp, tp, and ep when > 1), which its files
        depend on, and for the record the batch replicas as "dp" (every replica dim together); dims that keep the
        weights whole do not change the files."""
        sizes = {"dp": self.size(BATCH)}
        sizes.update({d.name: self.sizes[d.name] for d in GRID if d.role in ("stage", "shard")})
        if self.ep > 1:
            sizes[EXPERT_DIM] = self.ep
        return sizes

    def describe(self) -> str:
        return ", ".join(f"{d}={s}" for d, s in self.sizes.items())
