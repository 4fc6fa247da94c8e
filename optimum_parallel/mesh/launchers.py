"""Who started this process, read from the variables each launcher sets (torchrun and `accelerate launch`, the MPIs'
`mpirun`, SLURM's `srun`): `detect` returns a `Launch` -- this rank, the job's size, its place on its host, how many
ranks its host runs, and where rank 0's rendezvous store listens. A missing or malformed variable raises `LaunchError`
before anything starts. Design notes: docs/module_notes.md.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

TORCH_PORT = 29500  # torch's own default MASTER_PORT
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 10000  # every rank of a SLURM job derives the same port from its id
LOCALHOST = "127.0.0.1"


class LaunchError(ValueError):
    """A launcher's variable is missing or malformed."""


@dataclass(frozen=True)
class Launch:
    """This process's place in the job. `local_world_size` None: the launcher does not say how many ranks this host
    runs (a script setting RANK and WORLD_SIZE itself); `node`: the launcher's name for this host, if it has one."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int | None
    local_world_size: int | None
    master_addr: str
    master_port: int
    node: str | None = None

    @property
    def init_method(self) -> str:
        """torch's `tcp://` rendezvous URL of rank 0's store (an IPv6 address in brackets)."""
        host = f"[{self.master_addr}]" if ":" in self.master_addr and not self.master_addr.startswith("[") else None
        return f"tcp://{host or self.master_addr}:{self.master_port}"


@dataclass(frozen=True)
class _Mpi:
    launcher: str
    rank: str
    world: str
    local_rank: str
    local_world: str
    export: str  # how this launcher passes a variable to every rank


_MPIS = (
    _Mpi("mpirun (Open MPI)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
         "OMPI_COMM_WORLD_LOCAL_SIZE", "mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=29500 ..."),
    _Mpi("mpirun (MPICH / Intel MPI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
         "mpirun -genv MASTER_ADDR <host of rank 0> -genv MASTER_PORT 29500 ..."),
    _Mpi("mpirun (MVAPICH2)", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
         "MV2_COMM_WORLD_LOCAL_SIZE", "mpirun -genv MASTER_ADDR <host of rank 0> -genv MASTER_PORT 29500 ..."),
)  # fmt: skip


def detect(environ: Mapping[str, str] | None = None) -> Launch:
    """The launch this process is part of (one process alone when no launcher's variables are set)."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        return _torchrun(env)
    for mpi in _MPIS:
        if mpi.rank in env and (mpi.local_rank in env or "SLURM_PROCID" not in env):  # srun --mpi=pmi2 sets PMI_RANK
            return _mpi(env, mpi)
    if "SLURM_PROCID" in env:
        return _slurm(env)
    port = _int(env, "MASTER_PORT", "one process", 0) if "MASTER_PORT" in env else 0  # 0: any free port
    return Launch("one process", 0, 1, 0, 1, env.get("MASTER_ADDR", LOCALHOST), port)


def _torchrun(env: Mapping[str, str]) -> Launch:
    name = "torchrun (or accelerate launch, or RANK/WORLD_SIZE set by the script)"
    _require(env, name, ["RANK", "WORLD_SIZE"], "set both, or neither for one process")
    rank, world = _int(env, "RANK", name, 0), _int(env, "WORLD_SIZE", name, 1)
    local_rank = _int(env, "LOCAL_RANK", name, 0) if "LOCAL_RANK" in env else None
    local_world = _int(env, "LOCAL_WORLD_SIZE", name, 1) if "LOCAL_WORLD_SIZE" in env else None
    if world > 1:
        _require(env, name, ["MASTER_ADDR", "MASTER_PORT"], "torchrun sets them; a script must set them itself")
    port = _int(env, "MASTER_PORT", name, 0) if "MASTER_PORT" in env else 0
    node = env.get("GROUP_RANK")
    return _checked(Launch(name, rank, world, local_rank, local_world, env.get("MASTER_ADDR", LOCALHOST), port, node))


def _mpi(env: Mapping[str, str], mpi: _Mpi) -> Launch:
    _require(env, mpi.launcher, [mpi.rank, mpi.world, mpi.local_rank, mpi.local_world], "set by the launcher itself")
    rank, world = _int(env, mpi.rank, mpi.launcher, 0), _int(env, mpi.world, mpi.launcher, 1)
    local_rank, local_world = _int(env, mpi.local_rank, mpi.launcher, 0), _int(env, mpi.local_world, mpi.launcher, 1)
    addr = env.get("MASTER_ADDR")
    if addr is None:
        if local_world != world:
            raise LaunchError(
                f"MASTER_ADDR is not set: {mpi.launcher} started {world} ranks over several hosts ({mpi.local_world}="
                f"{local_world} on this one) and does not say where rank 0 is. Set MASTER_ADDR to rank 0's host name "
                f"or address (and MASTER_PORT to a free port, default {TORCH_PORT}) for every rank: {mpi.export}"
            )
        addr = LOCALHOST  # every rank on this host
    port = _int(env, "MASTER_PORT", mpi.launcher, 1) if "MASTER_PORT" in env else TORCH_PORT
    return _checked(Launch(mpi.launcher, rank, world, local_rank, local_world, addr, port))


def _slurm(env: Mapping[str, str]) -> Launch:
    name = "srun (SLURM)"
    world_var = _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    _require(env, name, ["SLURM_LOCALID", world_var or "SLURM_NTASKS"], "srun sets them for every task")
    rank, world = _int(env, "SLURM_PROCID", name, 0), _int(env, world_var, name, 1)
    local_rank, node = _int(env, "SLURM_LOCALID", name, 0), env.get("SLURM_NODEID")
    local_world = _slurm_local_world(env, name, node)
    addr = env.get("MASTER_ADDR")
    if addr is None:
        nodelist = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        if nodelist is None:
            raise LaunchError(f"{name}: none of SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_NODELIST is set, so "
                              "rank 0's host is unknown; set MASTER_ADDR to it for every task")  # fmt: skip
        addr = first_host(env[nodelist])
    if "MASTER_PORT" in env:
        port = _int(env, "MASTER_PORT", name, 1)
    elif "SLURM_JOB_ID" in env:
        port = SLURM_PORT_BASE + _int(env, "SLURM_JOB_ID", name, 0) % SLURM_PORT_SPAN
    else:
        raise LaunchError(f"{name}: neither MASTER_PORT nor SLURM_JOB_ID is set; set MASTER_PORT to a free port on "
                          "rank 0's host for every task (e.g. export MASTER_PORT=29500 before srun)")  # fmt: skip
    return _checked(Launch(name, rank, world, local_rank, local_world, addr, port, node))


def _slurm_local_world(env: Mapping[str, str], name: str, node: str | None) -> int:
    """This node's task count: its entry of the step's (else the job's) tasks-per-node list, or the uniform
    SLURM_NTASKS_PER_NODE."""
    listed = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if listed is not None:
        counts = tasks_per_node(env[listed], name, listed)
        if len(counts) == 1:
            return counts[0]
        _require(env, name, ["SLURM_NODEID"], f"needed to read this node's entry of {listed}")
        index = _int(env, "SLURM_NODEID", name, 0)
        if index >= len(counts):
            raise LaunchError(f"{name}: SLURM_NODEID={index} but {listed}={env[listed]!r} lists {len(counts)} nodes")
        return counts[index]
    _require(env, name, ["SLURM_NTASKS_PER_NODE"], "or SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE")
    return _int(env, "SLURM_NTASKS_PER_NODE", name, 1)


def tasks_per_node(value: str, launcher: str = "srun (SLURM)", variable: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """SLURM's compressed tasks-per-node list ("2(x3),1" -> [2, 2, 2, 1])."""
    counts: list[int] = []
    for part in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise LaunchError(f"{launcher}: {variable}={value!r} is not a tasks-per-node list like '2(x3),1'")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list ("gpu[07-09,12],cpu1" -> "gpu07"; "r[1-2]-n[3-4]" -> "r1-n3")."""
    depth, end = 0, len(nodelist)
    for i, char in enumerate(nodelist):  # the first entry: up to the first comma outside brackets
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = i
            break
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m[1])[0], nodelist[:end].strip())


def _first(env: Mapping[str, str], *names: str) -> str | None:
    return next((n for n in names if env.get(n, "").strip()), None)


def _require(env: Mapping[str, str], launcher: str, names: list[str], why: str) -> None:
    missing = [n for n in names if not env.get(n, "").strip()]
    if missing:
        raise LaunchError(f"{launcher}: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set ({why})")


def _int(env: Mapping[str, str], name: str, launcher: str, least: int) -> int:
    try:
        value = int(env[name])
    except ValueError:
        value = least - 1
    if value < least:
        raise LaunchError(f"{launcher}: {name}={env[name]!r} is not allowed; allowed: an integer >= {least}")
    return value


def _checked(launch: Launch) -> Launch:
    """The numbers agree: rank < world size, local rank < local world size <= world size."""
    problems = []
    if launch.rank >= launch.world_size:
        problems.append(f"rank {launch.rank} is not below the world size {launch.world_size}")
    if launch.local_world_size is not None:
        if launch.local_world_size > launch.world_size:
            problems.append(f"the host's {launch.local_world_size} ranks exceed the world size {launch.world_size}")
        if launch.local_rank is not None and launch.local_rank >= launch.local_world_size:
            problems.append(f"local rank {launch.local_rank} is not below the host's {launch.local_world_size} ranks")
    if launch.master_port > 65535:
        problems.append(f"MASTER_PORT={launch.master_port} is not a port (allowed: 1-65535)")
    if problems:
        raise LaunchError(f"{launch.launcher}: {'; '.join(problems)}")
    return launch
