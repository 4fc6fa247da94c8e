"""ParallelMesh: the named dp/pp/cp/tp process grid over a torch DeviceMesh, initialised from torchrun's env.

`ep` (expert parallelism) is not a dim of the grid: it groups the dp x cp ranks that share the dense weights into
blocks of `ep` consecutive ranks (`expert_group`) that hold disjoint sets of experts; the ranks at the same place
in every block hold the same experts (`expert_replica_group`).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import hang_report, rendezvous

# outermost to innermost: tp ranks are neighbours (fastest links), then cp (ring attention passes K/V every layer)
MESH_DIMS = ("dp", "pp", "cp", "tp")
DIM_ALIASES = {"mp": "tp"}
EXPERT_DIM = "ep"
_NO_EXPERT_PARALLELISM = "this mesh has no expert parallelism (ep=1); allowed: init_mesh(..., ep=N), N dividing dp x cp"
DEFAULT_TIMEOUT = timedelta(seconds=60)
DEVICE_TYPES = ("cpu", "cuda", "xla")
_GRACE = timedelta(seconds=3)  # how long a failed rank waits for the other survivors' reports (see hang_report)


@dataclass
class ParallelMesh:
    """A dp x pp x cp x tp grid of ranks; each named dim has its own process group (with a timeout).

    cp (context parallelism) splits the sequence, not the weights: the dp x cp ranks of one pp and tp coordinate
    hold the same parameters, and data parallelism averages gradients over all of them (`data_parallel_group`).
    """

    device_mesh: DeviceMesh
    sizes: dict[str, int]
    timeout: timedelta = DEFAULT_TIMEOUT
    _extra_groups: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict, repr=False)
    _dp_cp_mesh: DeviceMesh | None = field(default=None, repr=False)
    _sharding_meshes: dict[int, DeviceMesh] = field(default_factory=dict, repr=False)
    expert_parallel_size: int = 1
    _expert_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = field(default=None, repr=False)
    _expert_replica_mesh: DeviceMesh | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_expert_parallel_size(self.expert_parallel_size, self.sizes["dp"], self.sizes["cp"])
        # dp and cp are not adjacent (pp sits between): torch flattens the non-contiguous slice into one 1-D mesh
        # with its own process group. Created here, on every rank at once, as torch requires.
        if self.sizes["dp"] > 1 and self.sizes["cp"] > 1:
            backend_override = _gloo_or_nccl_options(self.timeout)
            self._dp_cp_mesh = self.device_mesh["dp", "cp"]._flatten("dp_cp", backend_override=backend_override)
        if self.expert_parallel_size > 1:
            self._expert_groups = self._make_expert_groups()

    def size(self, dim: str) -> int:
        if dim == EXPERT_DIM:
            return self.expert_parallel_size
        return self.sizes[_canonical_dim(dim)]

    def rank(self, dim: str) -> int:
        if dim == EXPERT_DIM:
            return self.data_parallel_rank % self.expert_parallel_size
        dim = _canonical_dim(dim)
        return self.device_mesh.get_local_rank(dim) if self.sizes[dim] > 1 else 0

    def group(self, dim: str) -> dist.ProcessGroup:
        if dim == EXPERT_DIM:
            return self.expert_group
        return self.device_mesh.get_group(_canonical_dim(dim))

    @property
    def expert_group(self) -> dist.ProcessGroup:
        """The `ep` ranks (consecutive in dp x cp, same pp and tp coordinate) whose experts together are all of them:
        tokens are dispatched among them."""
        if self._expert_groups is None:
            raise ValueError(_NO_EXPERT_PARALLELISM)
        return self._expert_groups[0]

    @property
    def expert_replica_group(self) -> dist.ProcessGroup:
        """The dp x cp / ep ranks holding the same experts (one per expert group): expert gradients are summed here."""
        if self._expert_groups is None:
            raise ValueError(_NO_EXPERT_PARALLELISM)
        return self._expert_groups[1]

    @property
    def expert_replica_mesh(self) -> DeviceMesh:
        """`expert_replica_group` as a 1-D DeviceMesh (FSDP2 shards the experts over it at sharding levels 2-3)."""
        if self._expert_replica_mesh is None:
            self._expert_replica_mesh = DeviceMesh.from_group(
                self.expert_replica_group, self.device_type, mesh_dim_names=("ep_replicate",)
            )
        return self._expert_replica_mesh

    def _make_expert_groups(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """Every rank creates every expert and replica group (torch requires it); returns this rank's two."""
        ep, me = self.expert_parallel_size, dist.get_rank()
        grid = self.device_mesh.mesh  # [dp, pp, cp, tp] -> lines of dp x cp ranks in data_parallel_rank order
        lines = grid.permute(1, 3, 0, 2).reshape(-1, self.data_parallel_size).tolist()
        expert = replica = None
        for line in lines:
            blocks = [line[i : i + ep] for i in range(0, len(line), ep)]
            for ranks in blocks + [line[i::ep] for i in range(ep)]:
                key = ("ep",) + tuple(ranks)
                if key not in self._extra_groups:
                    self._extra_groups[key] = dist.new_group(list(ranks), timeout=self.timeout)
            for ranks in blocks:
                if me in ranks:
                    expert = self._extra_groups[("ep",) + tuple(ranks)]
            for i in range(ep):
                if me in line[i::ep]:
                    replica = self._extra_groups[("ep",) + tuple(line[i::ep])]
        return expert, replica

    def ranks(self, dim: str) -> list[int]:
        """Global ranks of this rank's group along `dim`, in group-rank order."""
        return dist.get_process_group_ranks(self.group(dim))

    @property
    def tp_size(self) -> int:
        return self.sizes["tp"]

    @property
    def tp_rank(self) -> int:
        return self.rank("tp")

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.group("tp")

    @property
    def data_parallel_mesh(self) -> DeviceMesh:
        """The 1-D mesh of the ranks holding the same parameters (dp x cp at this pp and tp coordinate), which
        FSDP2 shards over; with cp=1 it is the dp sub-mesh."""
        if self.sizes["cp"] == 1:
            return self.device_mesh["dp"]
        if self.sizes["dp"] == 1:
            return self.device_mesh["cp"]
        return self._dp_cp_mesh

    @property
    def data_parallel_group(self) -> dist.ProcessGroup:
        """The process group gradients are averaged over (DDP, ZeRO-1, the pipeline): dp x cp; with cp=1, dp's."""
        if self.sizes["cp"] == 1:
            return self.group("dp")
        if self.sizes["dp"] == 1:
            return self.group("cp")
        return self._dp_cp_mesh.get_group()

    def sharding_mesh(self, shard_size: int = -1) -> DeviceMesh:
        """The mesh FSDP2 shards over: the 1-D `data_parallel_mesh` when `shard_size` is -1 or all dp x cp ranks;
        else the 2-D ("dp_replicate", "dp_shard") mesh of those ranks (HSDP): groups of `shard_size` consecutive
        ranks (in `data_parallel_rank` order) shard, and the ranks at the same place in every group replicate.
        Collective on every rank the first time (its groups are created, with the mesh timeout); cached."""
        size = self.data_parallel_size
        if shard_size in (-1, size):
            return self.data_parallel_mesh
        if shard_size < 1 or size % shard_size:
            raise ValueError(f"shard_size={shard_size} does not divide the dp x cp ranks ({size})")
        if shard_size not in self._sharding_meshes:
            backend = _gloo_or_nccl_options(self.timeout)
            self._sharding_meshes[shard_size] = self.data_parallel_mesh._unflatten(
                0,
                (size // shard_size, shard_size),
                ("dp_replicate", "dp_shard"),
                backend_override={"dp_replicate": backend, "dp_shard": backend},
            )
        return self._sharding_meshes[shard_size]

    def sharding_group(self, shard_size: int = -1) -> dist.ProcessGroup:
        """This rank's sharding group (ZeRO-1's and FSDP2's): `shard_size` ranks of dp x cp; -1: all of them."""
        mesh = self.sharding_mesh(shard_size)
        return mesh.get_group("dp_shard") if mesh.ndim == 2 else mesh.get_group()

    @property
    def data_parallel_size(self) -> int:
        """Ranks holding the same parameters: dp x cp."""
        return self.sizes["dp"] * self.sizes["cp"]

    @property
    def data_parallel_rank(self) -> int:
        """This rank's place in `data_parallel_group` (dp-major, as torch flattens dp x cp)."""
        return self.rank("dp") * self.sizes["cp"] + self.rank("cp")

    @property
    def device_type(self) -> str:
        return self.device_mesh.device_type

    def subgroups(self, dim: str, parts: int) -> dist.ProcessGroup:
        """Split every group along `dim` into `parts` contiguous blocks; return this rank's block's group.

        Used e.g. for the tp ranks that hold the same replicated kv head.
        """
        size = self.sizes[_canonical_dim(dim)]
        block = size // parts
        mine = [self.group_of(dim, range(start, start + block)) for start in range(0, size, block)]
        return next(group for group in mine if group is not None)

    def group_of(self, dim: str, positions) -> dist.ProcessGroup | None:
        """The group of the ranks at `positions` along `dim` (in every line of the mesh); None if this rank
        is not among them. Every rank takes part in creating every group (torch requires it); cached."""
        dim = _canonical_dim(dim)
        mine = None
        lines = self.device_mesh.mesh.movedim(MESH_DIMS.index(dim), -1).reshape(-1, self.sizes[dim])
        for line in lines.tolist():
            ranks = tuple(line[p] for p in positions)
            if ranks not in self._extra_groups:
                self._extra_groups[ranks] = dist.new_group(list(ranks), timeout=self.timeout)
            if dist.get_rank() in ranks:
                mine = self._extra_groups[ranks]
        return mine


_CURRENT_MESH: ParallelMesh | None = None


def _canonical_dim(dim: str) -> str:
    name = DIM_ALIASES.get(dim, dim)
    if name not in MESH_DIMS:
        allowed = ", ".join(MESH_DIMS + tuple(DIM_ALIASES) + (EXPERT_DIM,))
        raise ValueError(f"unknown mesh dim {dim!r}; allowed: {allowed}")
    return name


def check_expert_parallel_size(ep: object, dp: int, cp: int, key: str = "ep") -> int:
    """`ep` if it is a positive int dividing dp x cp; else ValueError naming `key` and the allowed values."""
    allowed = [d for d in range(1, dp * cp + 1) if (dp * cp) % d == 0]
    if isinstance(ep, bool) or not isinstance(ep, int) or ep not in allowed:
        raise ValueError(
            f"{key}={ep!r} is not allowed; expert parallelism splits the experts over ranks that share the dense "
            f"weights, so it must divide dp x cp = {dp} x {cp}; allowed: {', '.join(map(str, allowed))}"
        )
    return ep


def check_positive_int(name: str, value: object, what: str = "it") -> int:
    """`value` if it is a positive int (not a bool); else ValueError naming `name` and the value."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} is not allowed; {what} must be a positive integer")
    return value


_INIT_LOCK = threading.Lock()  # on XLA one process may drive several devices, one thread each: one group for all


def _device_type(device: str | None) -> str:
    """The device the mesh runs on: `device`, else XLA where torch-xla's runtime is configured (`PJRT_DEVICE`) or
    the process group already runs on the "xla" backend, else CUDA when there is one, else the CPU."""
    if device is None:
        if os.environ.get("PJRT_DEVICE") or (dist.is_initialized() and dist.get_backend() == "xla"):
            return "xla"
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = str(device).split(":")[0]
    if kind not in DEVICE_TYPES:
        raise ValueError(f"device={device!r} is not supported; allowed: {', '.join(DEVICE_TYPES)}")
    return kind


def _init_process_group(timeout: timedelta, device_type: str = "cpu") -> None:
    """Start torch.distributed from torchrun's environment (or a single local process); on XLA from torch-xla's
    runtime (`init_method="xla://"`), once per process however many devices it drives."""
    with _INIT_LOCK:
        if dist.is_initialized():
            return
        # torch.distributed.optim (ZeRO-1) imports torch.distributed.rpc; imported after a process group exists, it
        # made the process abort at exit ("terminate called without an active exception", 1 run in 3 of a 4-rank
        # job): import it before the group is made (0.2 s, only in processes that start torch.distributed)
        import torch.distributed.optim  # noqa: F401

        if device_type == "xla":
            try:
                import torch_xla.distributed.xla_backend  # noqa: F401  (registers the "xla" backend and "xla://")
            except ImportError as err:
                raise ImportError(
                    f"the mesh runs on XLA devices (device='xla' or PJRT_DEVICE={os.environ.get('PJRT_DEVICE')!r}) "
                    "but torch-xla does not import; install torch-xla (torch-neuronx on Neuron), or leave PJRT_DEVICE "
                    f"unset for gloo/NCCL ({err})"
                ) from err

            dist.init_process_group(backend="xla", init_method="xla://", timeout=timeout)
            return
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # restarts under torchrun's shared store need no TORCH_DISABLE_SHARE_RDZV_TCP_STORE (rendezvous.py)
        rendezvous.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout)


def _gloo_or_nccl_options(timeout: timedelta):
    """Backend options carrying `timeout`: DeviceMesh's sub-groups otherwise get torch's 30-minute default."""
    if torch.cuda.is_available():
        backend, options = "nccl", dist.ProcessGroupNCCL.Options()
    else:
        backend, options = "gloo", dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return backend, options


def init_mesh(
    dp: int = 1,
    tp: int | None = None,
    pp: int = 1,
    cp: int = 1,
    *,
    ep: int = 1,
    timeout: timedelta | float = DEFAULT_TIMEOUT,
    device: str | None = None,
    **aliases: int,
) -> ParallelMesh:
    """Build (and set as current) the dp x pp x cp x tp mesh; `tp` (alias `mp`) defaults to world / (dp * pp * cp).

    cp is context parallelism: each cp rank holds a share of every sequence and the same parameters.
    ep is expert parallelism: blocks of `ep` consecutive dp x cp ranks split the experts between them (ep divides
    dp x cp; dense weights stay replicated over dp x cp).

    Starts torch.distributed from the torchrun environment if needed (gloo on CPU, NCCL on CUDA, the "xla"
    backend on XLA devices: `device="xla"`, or `PJRT_DEVICE` set, e.g. NEURON); every process group of the mesh
    gets `timeout` (seconds or a timedelta), so a lost rank fails the run instead of hanging it.
    """
    for name, value in aliases.items():
        if DIM_ALIASES.get(name) != "tp":
            allowed = ", ".join(MESH_DIMS + tuple(DIM_ALIASES) + (EXPERT_DIM,))
            raise ValueError(f"unknown mesh dim {name!r}; allowed: {allowed}")
        if tp is not None and tp != value:
            raise ValueError(f"tp={tp} and its alias {name}={value} disagree; pass one of them")
        tp = value
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    device_type = _device_type(device)
    _init_process_group(timeout, device_type)
    world = dist.get_world_size()
    check_positive_int("dp", dp, "a mesh size")
    check_positive_int("pp", pp, "a mesh size")
    check_positive_int("cp", cp, "a mesh size")
    tp = world // (dp * pp * cp) if tp is None else tp
    check_positive_int("tp", tp, "a mesh size")
    check_expert_parallel_size(ep, dp, cp)
    sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
    total = dp * pp * cp * tp
    if total != world:
        raise ValueError(f"mesh dp={dp} x pp={pp} x cp={cp} x tp={tp} = {total} ranks, but the world size is {world}")
    if device_type == "xla":
        from .xla_mesh import XlaParallelMesh  # torch-xla's replica groups, no DeviceMesh

        return set_mesh(XlaParallelMesh(None, sizes, timeout, expert_parallel_size=ep))
    backend, options = _gloo_or_nccl_options(timeout)
    overrides = {name: (backend, options) for name in MESH_DIMS}
    shape = tuple(sizes[name] for name in MESH_DIMS)
    device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS, backend_override=overrides)
    # a collective that fails because a rank never came says which one, on which group, and who is missing
    hang_report.install(
        {device_mesh.get_group(name): name for name in MESH_DIMS}, min(max(timeout / 2, _GRACE), _GRACE * 3)
    )
    return set_mesh(ParallelMesh(device_mesh, sizes, timeout, expert_parallel_size=ep))


def set_mesh(mesh: ParallelMesh) -> ParallelMesh:
    """Make `mesh` the one `get_mesh()` and the front doors use when none is passed."""
    global _CURRENT_MESH
    if not isinstance(mesh, ParallelMesh):
        raise TypeError(f"set_mesh expects a ParallelMesh (from init_mesh), got {type(mesh).__name__}")
    _CURRENT_MESH = mesh
    return mesh


def get_mesh() -> ParallelMesh:
    if _CURRENT_MESH is None:
        raise RuntimeError(
            "no parallel mesh is set: call optimum_parallel.init_mesh(dp=..., tp=..., pp=..., cp=...) first"
        )
    return _CURRENT_MESH
