"""torch.distributed's default group on a store that no earlier attempt of a torchrun job wrote to. `init_process_group`
starts the group from the launcher's variables (launchers.py); under torchrun's shared agent store, its keys go under
a prefix of this attempt's own (`attempt_store`). Where the backend cannot share a device, it first checks that no two
ranks of a host use one device (`check_one_rank_per_device`). `init_before_accelerate` makes the group for
`ParallelTrainingArguments` before accelerate does. Design notes: docs/module_notes.md.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from . import binding, launchers, timeouts
from . import device as devices
from .clean_exit import destroy_at_clean_exit
from .heartbeat import HeartbeatSettings

VARIABLE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_ADDRESS_KEY = "optimum_parallel/rendezvous/rank0"  # in the agent's store: "host:port:token" of rank 0's small store
_TOKEN_KEY = "optimum_parallel/rendezvous/token"  # in rank 0's small store: the same token
_PREFIX = "optimum_parallel/attempt-{}/"  # this attempt's keys in the agent's store
_DEVICES_KEY = "optimum_parallel/devices/{}/{}"  # (host, local rank) -> "rank|host|device", checked before NCCL starts
_RANK_DEVICE_KEY = "optimum_parallel/devices/rank/{}"  # rank -> the same, where the launcher does not count its host
_KEEP: list = []  # rank 0's small store, alive as long as the process
_PROBE_S = 2.0  # a connect to a stale address fails at once on a live host; a dead host gets this long
_RETRY_S = 0.05


def shares_agent_store() -> bool:
    """Whether torchrun gave the workers its agent's rendezvous store (its default; the variable turns it off)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def init_process_group(
    backend: str,
    timeout: timedelta,
    device_id: torch.device | None = None,
    launch: launchers.Launch | None = None,
) -> None:
    """`dist.init_process_group(backend, timeout=timeout, device_id=device_id)` with the rank, world size and rank 0's
    address of `launch` (by default read from the launcher's variables: launchers.py), passed to torch rather than
    through the environment; under torchrun's shared store, on a store of this attempt's own (docs/module_notes.md).
    `device_id`: this process's accelerator device, bound to the group (NCCL then connects at once, and DeviceMesh
    splits its sub-groups from it, where the backend can split: binding.py); under a backend that cannot share a
    device, two ranks of a host on one device raise first, on each of them."""
    launch = launchers.detect() if launch is None else launch
    rank, world = launch.rank, launch.world_size
    if "nccl" in backend:
        timeouts.nccl_report_defaults()  # read when the NCCL group is made
    check = device_id is not None and world > 1 and not devices.shares_devices(backend)
    if shares_agent_store():
        store = attempt_store(rank, world, timeout, launch.master_addr, launch.master_port)
    elif check:  # the store init_process_group would make itself, made first for the device check
        rendezvous = dist.rendezvous(launch.init_method, rank, world, timeout=timeout)
        store = dist.PrefixStore("default_pg", next(rendezvous)[0])
    else:
        dist.init_process_group(
            backend=backend,
            init_method=launch.init_method,
            rank=rank,
            world_size=world,
            timeout=timeout,
            device_id=device_id,
        )
        binding.keep_only_where_split_works()
        destroy_at_clean_exit()
        return
    if check:
        check_one_rank_per_device(
            store, rank, device_id, timeout, launch.local_rank, launch.local_world_size, world=world, node=launch.node
        )
    dist.init_process_group(
        backend=backend, store=store, rank=rank, world_size=world, timeout=timeout, device_id=device_id
    )
    binding.keep_only_where_split_works()
    destroy_at_clean_exit()


def check_one_rank_per_device(
    store: dist.Store,
    rank: int,
    device: torch.device,
    timeout: timedelta,
    local_rank: int | None = None,
    local_world: int | None = None,
    *,
    world: int | None = None,
    node: str | None = None,
) -> None:
    """Every rank of this host posts its device in `store` and reads its neighbours'; raises (on each of them) when
    two map to one physical device, naming the ranks and the device. `local_rank`, `local_world`: this rank's place
    on its host and how many ranks the host runs, as the launcher says (launchers.py). Where it does not say, every
    rank of the job (`world`) posts and reads all: a host's count guessed as the job's size waited, on several hosts,
    for keys that could never come. `node`: the launcher's name for this host (devices.host_identity)."""
    host = devices.host_identity(node)
    if local_rank is not None and local_world is not None:
        mine, keys = _DEVICES_KEY.format(host, local_rank), [_DEVICES_KEY.format(host, r) for r in range(local_world)]
    elif world is not None:
        mine, keys = _RANK_DEVICE_KEY.format(rank), [_RANK_DEVICE_KEY.format(r) for r in range(world)]
    else:
        raise ValueError("check_one_rank_per_device needs local_rank and local_world, or world")
    store.set(mine, f"{rank}|{host}|{devices.device_identity(device)}")
    store.wait(keys, timeout)
    claims = {}
    for key in keys:
        other, other_host, identity = store.get(key).decode().split("|", 2)
        claims[int(other)] = (other_host, identity)
    message = devices.duplicate_devices(claims)
    if message:
        raise RuntimeError(message)


def attempt_store(rank: int, world: int, timeout: timedelta, host: str, port: int) -> dist.Store:
    """The agent's store (at `host`:`port`, torchrun's MASTER_ADDR and MASTER_PORT) under a prefix that only this
    attempt's ranks use (rank 0's token, see docs/module_notes.md)."""
    deadline = time.monotonic() + timeout.total_seconds()
    try:
        agent = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    except (RuntimeError, OSError) as err:
        raise RuntimeError(_unreachable(f"torchrun's rendezvous store at {host}:{port} ({err})")) from err
    if rank == 0:
        token = uuid.uuid4().hex
        own = dist.TCPStore(host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        own.set(_TOKEN_KEY, token)
        _KEEP.append(own)
        agent.set(_ADDRESS_KEY, f"{host}:{own.port}:{token}")
        return dist.PrefixStore(_PREFIX.format(token), agent)
    last = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RuntimeError(_unreachable(f"rank 0's store (last address read: {last})"))
        agent.set_timeout(timedelta(seconds=remaining))
        try:
            last = agent.get(_ADDRESS_KEY).decode()
        except RuntimeError as err:  # rank 0 never published within the timeout
            raise RuntimeError(_unreachable(f"rank 0's store ({err})")) from err
        if _live(last, world):
            agent.set_timeout(timeout)
            return dist.PrefixStore(_PREFIX.format(last.rsplit(":", 1)[1]), agent)
        time.sleep(_RETRY_S)


def _live(address: str, world: int) -> bool:
    """Whether `address` ("host:port:token") is this attempt's rank 0: its store is up and holds `token`."""
    host, port, token = address.rsplit(":", 2)
    try:
        with socket.create_connection((host, int(port)), timeout=_PROBE_S):
            pass
    except OSError:  # an earlier attempt's rank 0: gone
        return False
    try:
        store = dist.TCPStore(host, int(port), world, is_master=False, timeout=timedelta(seconds=_PROBE_S))
        return store.get(_TOKEN_KEY).decode() == token  # else the port was taken again, by another attempt's rank 0
    except (RuntimeError, OSError):
        return False


def _unreachable(what: str) -> str:
    return (
        f"could not reach {what}, so this attempt of the torchrun job cannot form its process group. Where the "
        "ranks cannot reach rank 0's address (MASTER_ADDR) on another port, start the torchrun agents with "
        f"{VARIABLE}=1"
    )


def init_before_accelerate(ddp_backend: str | None, use_cpu: bool, timeout_s: float) -> None:
    """For `ParallelTrainingArguments`, before transformers has accelerate make the default group (on the shared
    store, where a restarted attempt would read the dead one's keys): make it here, with accelerate's backend and
    timeout; accelerate then uses it. Nothing off torchrun's shared store, on XLA, or once a group exists."""
    HeartbeatSettings.of()  # a bad OPTIMUM_PARALLEL_HEARTBEAT_* variable raises here, before any group is made
    if not shares_agent_store() or int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    if devices.xla_requested() or "torch_xla" in sys.modules:  # accelerate's xla:// group: no TCPStore
        return
    device_type = devices.HOST if use_cpu else devices.resolve_device_type()
    if ddp_backend is None:
        ddp_backend = devices.backend_for(device_type)
    launch = launchers.detect()
    device_id = devices.set_process_device(device_type, local_rank=launch.local_rank)  # as accelerate does first
    init_process_group(ddp_backend, timedelta(seconds=timeout_s), device_id, launch)
