"""This rank's number and its group's size, the one place the package asks for them.

On CPU and CUDA they are torch.distributed's. On XLA devices (Neuron, and torch-xla's CPU device in the tests)
torch-xla's runtime says which device this is: torch.distributed's rank is per process, and where one process
drives several devices (one thread each) it is 0 on every one of them. The XLA branch never imports torch_xla
itself: it runs only once a process group on the "xla" backend exists, which needs torch_xla loaded.

XLA compiles a graph per distinct program, so what differs by rank must reach the device as data, never as a
constant of the graph: `device_indices` and `device_scalar` make such data on the CPU and move it to the device.
"""

from __future__ import annotations

import pickle
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from . import device as devices

XLA_BACKEND = devices.XLA
LINES_ATTR = "_op_lines"  # on an XLA group made by the mesh: the rank lists of every group of its dim


def on_xla() -> bool:
    """Whether torch.distributed runs on the XLA backend (cheap when torch_xla was never imported)."""
    return "torch_xla" in sys.modules and dist.is_initialized() and dist.get_backend() == XLA_BACKEND


def global_rank() -> int:
    """This rank in the world: torch-xla's device ordinal on XLA, else torch.distributed's rank (0 without it)."""
    if on_xla():
        import torch_xla.runtime  # already loaded with the backend

        return torch_xla.runtime.global_ordinal()
    return dist.get_rank() if dist.is_initialized() else 0


def group_ranks(group: dist.ProcessGroup | None = None) -> list[int]:
    """The global ranks of `group` (None: the world) that hold this rank, in group-rank order."""
    if group is None or group is dist.group.WORLD:
        return list(range(world_size()))
    lines = getattr(group, LINES_ATTR, None)
    if lines is not None and on_xla():  # one group object may serve every line of its dim (see mesh/xla_mesh.py)
        me = global_rank()
        return list(next(line for line in lines if me in line))
    return dist.get_process_group_ranks(group)


def rank(group: dist.ProcessGroup | None = None) -> int:
    """This rank's place in `group` (None: the world)."""
    if not on_xla():
        return dist.get_rank(group)
    return group_ranks(group).index(global_rank())


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """How many ranks `group` (None: the world) has."""
    return dist.get_world_size(group)


_DEVICE_DATA: dict[tuple, torch.Tensor] = {}


def device_indices(start: int, length: int, device: torch.device) -> torch.Tensor:
    """`arange(start, start + length)` on `device`, made on the CPU and moved (cached): on XLA a graph input, so
    graphs that slice at a rank's offset are the same program on every rank."""
    key = ("arange", start, length, str(device))
    if key not in _DEVICE_DATA:
        _DEVICE_DATA[key] = torch.arange(start, start + length).to(device)
    return _DEVICE_DATA[key]


def device_vector(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """`values` as a float32 vector on `device`, made on the CPU and moved (cached): a graph input on XLA, so that
    weights that differ by rank keep one program for every rank."""
    key = ("vector", values, str(device))
    if key not in _DEVICE_DATA:
        _DEVICE_DATA[key] = torch.tensor(values, dtype=torch.float32).to(device)
    return _DEVICE_DATA[key]


def device_scalar(value: int, device: torch.device) -> torch.Tensor | int:
    """`value` as a one-element tensor on an XLA `device` (a graph input, see `device_indices`; not 0-d: torch-xla
    turns a 0-d 0 or 1 into a constant of the graph, so rank 0's graph would differ); elsewhere the int itself."""
    if not devices.is_graph_device(device):
        return value
    key = ("scalar", value, str(device))
    if key not in _DEVICE_DATA:
        _DEVICE_DATA[key] = torch.tensor([value]).to(device)
    return _DEVICE_DATA[key]


_EXCHANGES: dict[int, int] = {}  # global rank -> how many object exchanges it made (one thread per rank on XLA)


def all_gather_object(obj: object, timeout: timedelta = timedelta(seconds=300)) -> list:
    """`obj` from every rank of the world, in rank order. torch.distributed's `all_gather_object` moves pickles
    through CPU tensors, which the XLA backend refuses: there they go through the rendezvous store."""
    if not on_xla():
        out: list = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    me, world = global_rank(), world_size()
    count = _EXCHANGES[me] = _EXCHANGES.get(me, 0) + 1
    store = dist.distributed_c10d._get_default_store()
    keys = [f"optimum_parallel/objects/{count}/{r}" for r in range(world)]
    store.set(keys[me], pickle.dumps(obj))
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check(keys):  # polled: a blocking wait holds the store client that the other threads share
        if time.monotonic() > deadline:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            raise TimeoutError(f"rank {me}: ranks {missing} did not join object exchange {count} in {timeout}")
        time.sleep(0.005)
    return [pickle.loads(store.get(key)) for key in keys]
