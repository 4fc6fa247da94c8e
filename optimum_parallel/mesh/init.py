"""`init_mesh`: start torch.distributed on the accelerator torch reports (or the one named) with the backend its
package registered, and build the grid; `set_mesh` / `get_mesh`: the mesh the entry points (the `Parallelizer`,
`parallelize`) use when none is passed."""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import torch.distributed as dist

from . import binding, heartbeat, launchers, rendezvous, timeouts
from . import device as devices
from .heartbeat import HeartbeatSettings
from .layout import ALIASES, EXPERT_DIM, GRID_DIMS, MeshLayout
from .protocol import ParallelMesh
from .timeouts import Timeouts

DEFAULT_TIMEOUT = timeouts.WATCHED_TIMEOUT  # with the heartbeat on (the default); timeouts.INIT_TIMEOUT without
_INIT_LOCK = threading.Lock()  # on XLA one process may drive several devices, one thread each: one group for all
_CURRENT_MESH: ParallelMesh | None = None


def init_mesh(
    dp: int = 1,
    tp: int | None = None,
    pp: int = 1,
    cp: int = 1,
    *,
    ep: int = 1,
    timeout: Timeouts | timedelta | float | None = None,
    train_timeout: timedelta | float | None = None,
    device: str | None = None,
    heartbeat_interval: float | None = None,
    heartbeat_dead_after: float | None = None,
    **dims: int,
) -> ParallelMesh:
    """Build (and set as current) the dp x pp x cp x tp mesh; `tp` (alias `mp`) defaults to world / (dp * pp * cp).

    cp is context parallelism: each cp rank holds a share of every sequence and the same parameters.
    ep is expert parallelism: blocks of `ep` consecutive dp x cp ranks split the experts between them (ep divides
    dp x cp; dense weights stay replicated over dp x cp). Any other dim of the table (`layout.GRID`) is given by its
    name, `mp` for tp.

    `device`: any device type torch knows ("cuda", "neuron", "npu", "xpu", "cpu", or "xla" for torch-xla); by default
    torch's current accelerator (the CPU without one; XLA where `PJRT_DEVICE` is set). Starts torch.distributed if
    needed from the variables of the launcher that started the process (torchrun, accelerate launch, srun, mpirun:
    launchers.py), with the backend the device's package registered (gloo on the CPU, nccl on CUDA, neuron on
    Trainium, ...), bound to this process's device (its local rank's, set first in every path) where the backend can
    split groups from it (binding.py).

    Heartbeat (`heartbeat.py`): every rank beats through the rendezvous store every `heartbeat_interval` seconds
    (default 2, or OPTIMUM_PARALLEL_HEARTBEAT_INTERVAL; 0: off); a rank silent for `heartbeat_dead_after` seconds
    (default 15, or OPTIMUM_PARALLEL_HEARTBEAT_DEAD_AFTER) is dead or frozen, and the ranks that see it end the job.

    Timeouts (`timeouts.py`): with the heartbeat, every process group waits `timeout` (seconds or a timedelta; default
    30 minutes) in every phase, unless `train_timeout` is given for the time after the first optimizer step. Without
    it, `timeout` (default 10 minutes) until this process's first optimizer step ends and around checkpoint saves and
    loads, `train_timeout` (default 2 minutes, or `timeout` if shorter) in between. Or pass one
    `Timeouts(init=..., train=...)` as `timeout`.
    """
    # bad settings raise here, on every rank, before anything starts
    beat = HeartbeatSettings.of(heartbeat_interval, heartbeat_dead_after)
    chosen = Timeouts.of(timeout, train_timeout, watched=beat.on)
    sizes: dict[str, int | None] = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
    for name, value in dims.items():
        dim = ALIASES.get(name, name)
        if dim not in GRID_DIMS:
            allowed = ", ".join(GRID_DIMS + tuple(ALIASES) + (EXPERT_DIM,))
            raise ValueError(f"unknown mesh dim {name!r}; allowed: {allowed}")
        if sizes.get(dim) is not None and dim in ALIASES.values() and sizes[dim] != value:
            raise ValueError(f"{dim}={sizes[dim]} and its alias {name}={value} disagree; pass one of them")
        sizes[dim] = value
    device_type = devices.resolve_device_type(device)
    _init_process_group(chosen.init, device_type)
    if device_type == devices.XLA or not heartbeat.start(beat):  # XLA: torch-xla's runtime has no store to beat in
        chosen = Timeouts.of(timeout, train_timeout)  # the timeouts alone tell a slow rank from a dead one
    timeouts.configure(chosen)  # every group, the default one included, waits the init timeout from here
    layout = MeshLayout.for_world(dist.get_world_size(), sizes, ep)
    if device_type == devices.XLA:
        from .xla_mesh import XlaParallelMesh  # torch-xla's replica groups, no DeviceMesh

        return set_mesh(XlaParallelMesh(layout, chosen.init))
    from .torch_mesh import TorchMesh

    return set_mesh(TorchMesh(layout, device_type, chosen.init))


def _init_process_group(timeout: timedelta, device_type: str) -> None:
    """Start torch.distributed from the launcher's variables (launchers.py: torchrun, accelerate launch, srun,
    mpirun; or one local process) on `device_type`'s backend;
    on XLA from torch-xla's runtime (`init_method="xla://"`), once per process however many devices it drives."""
    with _INIT_LOCK:
        if dist.is_initialized():  # made by the caller (or accelerate): its device still comes first, before the mesh
            devices.set_process_device(device_type, bound=_bound_device(), local_rank=_local_rank())
            binding.keep_only_where_split_works()  # a caller's group bound on gloo underneath would fail the mesh too
            return
        # torch.distributed.optim (ZeRO-1) imports torch.distributed.rpc; imported after a process group exists, it
        # made the process abort at exit ("terminate called without an active exception", 1 run in 3 of a 4-rank
        # job): import it before the group is made (0.2 s, only in processes that start torch.distributed)
        import torch.distributed.optim  # noqa: F401

        if device_type == devices.XLA:
            try:
                import torch_xla.distributed.xla_backend  # noqa: F401  (registers the "xla" backend and "xla://")
            except ImportError as err:
                raise ImportError(
                    f"the mesh runs on XLA devices (device='xla' or PJRT_DEVICE={os.environ.get('PJRT_DEVICE')!r}) "
                    "but torch-xla does not import; install torch-xla (torch-neuronx on Neuron), or leave PJRT_DEVICE "
                    f"unset for the native backends ({err})"
                ) from err

            dist.init_process_group(backend=devices.XLA, init_method="xla://", timeout=timeout)
            return
        launch = launchers.detect()  # a missing or malformed launcher variable raises here, before anything changes
        device_id = devices.set_process_device(device_type, local_rank=launch.local_rank)
        # restarts under torchrun's shared store need no TORCH_DISABLE_SHARE_RDZV_TCP_STORE (rendezvous.py)
        rendezvous.init_process_group(devices.backend_for(device_type), timeout, device_id, launch)


def _local_rank() -> int | None:
    """This process's place on its host by its launcher's variables, for a caller that made the group itself (who
    may have used others: then `LOCAL_RANK`, as before)."""
    try:
        return launchers.detect().local_rank
    except launchers.LaunchError:
        return None


def _bound_device():
    """The device the caller's default group was bound to (`init_process_group(device_id=...)`), if any."""
    return getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)


def set_mesh(mesh: ParallelMesh) -> ParallelMesh:
    """Make `mesh` the one `get_mesh()` and the entry points (the `Parallelizer`, `parallelize`) use when none is
    passed."""
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
