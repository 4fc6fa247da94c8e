"""Jobs started by torchrun, `accelerate launch`, SLURM's `srun` and `mpirun` (optimum_parallel/mesh/launchers.py):
each launcher's variables mapped to the rank, the world, the host's ranks and rank 0's address, a missing or bad one
named with its launcher; and real starts on one host of plain processes given only one launcher's variables, each
running `op.init_mesh(tp=2)` and an all-reduce, ended in seconds (a wait on keys that cannot come lasts the init
timeout, 120 s here). The same across the two network-namespace hosts: tests/test_hosts_launchers.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from optimum_parallel.mesh.launchers import LaunchError, detect, first_host, tasks_per_node
from optimum_parallel.mesh.ports import free_port

TESTS = Path(__file__).parent
ROOT = TESTS.parent
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "MPI_LOCAL", "MV2_", "TORCHELASTIC_")
LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"}
INIT_TIMEOUT_S = 120  # the children's: a rank waiting for a peer that cannot come would wait this long
FAST_S = 60  # a start that ends sooner waited on nothing that could not come (2 contended cores, cold imports)


# ---- the mapping ------------------------------------------------------------------------------------------------
def _where(launch) -> tuple:
    return (launch.rank, launch.world_size, launch.local_rank, launch.local_world_size, launch.master_addr,
            launch.master_port)  # fmt: skip


TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "n0",
            "MASTER_PORT": "29400", "GROUP_RANK": "1"}  # fmt: skip
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
         "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4321987"}  # fmt: skip
OMPI = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": "n0"}  # fmt: skip
HYDRA = {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4", "MASTER_ADDR": "n0"}


@pytest.mark.parametrize(
    ("env", "launcher", "where"),
    [
        ({}, "one process", (0, 1, 0, 1, "127.0.0.1", 0)),
        (TORCHRUN, "torchrun", (5, 8, 1, 4, "n0", 29400)),  # accelerate launch sets the same variables
        ({**SLURM}, "srun", (5, 8, 1, 4, "gpu07", 20000 + 4321987 % 10000)),
        ({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "3,5", "SLURM_STEP_NUM_TASKS": "8"}, "srun",
         (5, 8, 1, 5, "gpu07", 21987)),  # the step's own list wins over the job's
        ({**SLURM, "SLURM_TASKS_PER_NODE": "", "SLURM_NTASKS_PER_NODE": "4"}, "srun", (5, 8, 1, 4, "gpu07", 21987)),
        ({**SLURM, "SLURM_STEP_NODELIST": "cpu3,gpu[07-08]", "MASTER_PORT": "29501"}, "srun",
         (5, 8, 1, 4, "cpu3", 29501)),
        (OMPI, "Open MPI", (5, 8, 1, 4, "n0", 29500)),
        ({**OMPI, "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "MASTER_ADDR": ""}, "Open MPI",
         (1, 4, 1, 4, "127.0.0.1", 29500)),  # every rank on this host: rank 0 is here
        (HYDRA, "MPICH", (5, 8, 1, 4, "n0", 29500)),
        ({"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": "1",
          "MV2_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_PORT": "1234"}, "MVAPICH2", (1, 2, 1, 2, "127.0.0.1", 1234)),
        ({**SLURM, **TORCHRUN}, "torchrun", (5, 8, 1, 4, "n0", 29400)),  # srun torchrun ...: torchrun's ranks
        ({**SLURM, "SLURM_PROCID": "0", **OMPI}, "Open MPI", (5, 8, 1, 4, "n0", 29500)),  # mpirun inside sbatch
        ({**SLURM, "PMI_RANK": "5", "PMI_SIZE": "8"}, "srun", (5, 8, 1, 4, "gpu07", 21987)),  # srun --mpi=pmi2
    ],
)  # fmt: skip
def test_each_launchers_variables(env, launcher, where):
    launch = detect({k: v for k, v in env.items() if v})  # "": unset
    assert launcher in launch.launcher and _where(launch) == where, launch


def test_torchrun_without_local_world_size_leaves_it_unknown():
    """A script that sets RANK/WORLD_SIZE itself: the host's rank count is not guessed as the job's (the device
    check then reads every rank's post: rendezvous.check_one_rank_per_device)."""
    launch = detect({"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "a", "MASTER_PORT": "1"})
    assert launch.local_world_size is None and launch.local_rank is None


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"RANK": "0"}, ["torchrun", "WORLD_SIZE"]),
        ({"RANK": "1", "WORLD_SIZE": "2"}, ["torchrun", "MASTER_ADDR", "MASTER_PORT"]),
        ({**TORCHRUN, "RANK": "x"}, ["RANK='x'", "allowed: an integer >= 0"]),
        ({**TORCHRUN, "RANK": "8"}, ["rank 8 is not below the world size 8"]),
        ({**TORCHRUN, "LOCAL_WORLD_SIZE": "9"}, ["exceed the world size"]),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, ["MASTER_PORT=70000", "1-65535"]),
        ({**OMPI, "MASTER_ADDR": ""}, ["MASTER_ADDR is not set", "Open MPI", "mpirun -x MASTER_ADDR="]),
        ({**HYDRA, "MASTER_ADDR": ""}, ["MASTER_ADDR is not set", "MPICH", "-genv MASTER_ADDR"]),
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, ["MPICH", "MPI_LOCALRANKID, MPI_LOCALNRANKS are not set"]),
        ({**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": ""}, ["Open MPI", "OMPI_COMM_WORLD_LOCAL_SIZE is not set"]),
        ({**SLURM, "SLURM_LOCALID": ""}, ["srun (SLURM)", "SLURM_LOCALID is not set"]),
        ({**SLURM, "SLURM_NTASKS": ""}, ["srun (SLURM)", "SLURM_NTASKS is not set"]),
        ({**SLURM, "SLURM_TASKS_PER_NODE": ""}, ["SLURM_NTASKS_PER_NODE is not set"]),
        ({**SLURM, "SLURM_NODEID": ""}, ["SLURM_NODEID is not set", "SLURM_TASKS_PER_NODE"]),
        ({**SLURM, "SLURM_TASKS_PER_NODE": "4(x2"}, ["SLURM_TASKS_PER_NODE='4(x2'", "'2(x3),1'"]),
        ({**SLURM, "SLURM_NODEID": "2"}, ["SLURM_NODEID=2", "lists 2 nodes"]),
        ({**SLURM, "SLURM_JOB_NODELIST": ""}, ["SLURM_STEP_NODELIST", "set MASTER_ADDR"]),
        ({**SLURM, "SLURM_JOB_ID": ""}, ["neither MASTER_PORT nor SLURM_JOB_ID", "MASTER_PORT"]),
    ],
)
def test_a_missing_or_bad_variable_is_named_with_its_launcher(env, named):
    with pytest.raises(LaunchError) as raised:
        detect({k: v for k, v in env.items() if v})
    for words in named:
        assert words in str(raised.value), str(raised.value)


def test_slurm_lists():
    assert first_host("gpu[07-09,12],cpu1") == "gpu07" and first_host("r[1-2]-n[3-4],x") == "r1-n3"
    assert first_host("node5") == "node5" and first_host("a,b") == "a"
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1] and tasks_per_node("4") == [4]


# ---- real starts on one host -----------------------------------------------------------------------------------
JOB = """
import os, sys, time
start = time.monotonic()
if {exclusive!r}:  # the simulated accelerator with a backend as exclusive as NCCL: the per-host device check runs
    sys.path[:0] = [{accel!r}]
    import simulated_neuron
    simulated_neuron.install()
    from optimum_parallel.mesh import device as devices
    devices.EXCLUSIVE_BACKENDS = frozenset({{simulated_neuron.BACKEND}})
import torch, torch.distributed as dist
import optimum_parallel as op
try:
    mesh = op.init_mesh(dp=int(sys.argv[1]), tp=2, timeout={timeout})
except ValueError as err:
    os.write(1, f"raised: {{err}}\\n".encode())
    sys.exit(3)
from optimum_parallel.mesh import device as devices
x = torch.full((2,), float(dist.get_rank() + 1), device=devices.collective_device(mesh.group("tp")))
dist.all_reduce(x, group=mesh.group("tp"))
os.write(1, f"rank {{dist.get_rank()}} of {{dist.get_world_size()}}: {{x.cpu().tolist()}} in "
            f"{{time.monotonic() - start:.1f}} s\\n".encode())
"""


def _plain_env() -> dict[str, str]:
    """This process's environment without any launcher's variables (pytest may itself run under one)."""
    keep = {k: v for k, v in os.environ.items() if k not in LAUNCHER_NAMES and not k.startswith(LAUNCHER_PREFIXES)}
    paths = [str(ROOT), str(TESTS)]
    return {**keep, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(paths + [keep.get("PYTHONPATH", "")])}


def start(
    tmp_path: Path, envs: list[dict[str, str]], exclusive: bool = False, prefixes=None, world: int | None = None
) -> tuple[list, float]:
    """Start one plain process per `envs` entry (only its launcher's variables; `prefixes`: each one's command
    prefix, e.g. the network namespace it runs in) on a dp x tp=2 mesh of `world` ranks (by default one per entry);
    their (return code, output) and the wall time until the last ended."""
    dp = str((world or len(envs)) // 2)
    script = tmp_path / "job.py"
    script.write_text(JOB.format(exclusive=exclusive, accel=str(TESTS / "accel"), timeout=INIT_TIMEOUT_S))
    began = time.monotonic()
    procs = [
        subprocess.Popen([*prefix, sys.executable, str(script), dp], env={**_plain_env(), **env}, cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for prefix, env in zip(prefixes or [()] * len(envs), envs, strict=True)
    ]  # fmt: skip
    out = []
    for proc in procs:
        try:
            text, _ = proc.communicate(timeout=INIT_TIMEOUT_S + 60)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(f"ranks still running after {INIT_TIMEOUT_S + 60} s") from None
        out.append((proc.returncode, text))
    return out, time.monotonic() - began


def srun_env(world: int, per_node: int, port_job: int | None = None, nodelist: str = "127.0.0.1") -> list[dict]:
    """What `srun -n world --ntasks-per-node per_node` gives each task (the port derived from SLURM_JOB_ID)."""
    if port_job is None:
        port = free_port(range(20000 + os.getpid() % 9000, 30000))
        port_job = 7_000_000 + port - 20000
    nodes = world // per_node
    return [
        {"SLURM_PROCID": str(r), "SLURM_NTASKS": str(world), "SLURM_LOCALID": str(r % per_node),
         "SLURM_NODEID": str(r // per_node), "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})",
         "SLURM_STEP_NODELIST": nodelist, "SLURM_JOB_ID": str(port_job), "SLURM_STEP_ID": "0"}
        for r in range(world)
    ]  # fmt: skip


def mpirun_env(world: int, per_node: int, port: int, addr: str | None = None) -> list[dict]:
    """What Open MPI's `mpirun -np world` gives each rank (plus MASTER_PORT, and MASTER_ADDR where given)."""
    extra = {"MASTER_PORT": str(port), **({"MASTER_ADDR": addr} if addr else {})}
    return [
        {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": str(world),
         "OMPI_COMM_WORLD_LOCAL_RANK": str(r % per_node), "OMPI_COMM_WORLD_LOCAL_SIZE": str(per_node), **extra}
        for r in range(world)
    ]  # fmt: skip


def assert_ran(out: list, seconds: float, world: int) -> None:
    logs = "\n".join(f"--- process {i} (rc {rc}) ---\n{text[-2500:]}" for i, (rc, text) in enumerate(out))
    assert all(rc == 0 for rc, _ in out), logs
    for r in range(world):
        partner = r ^ 1  # tp=2: consecutive ranks
        expected = float(r + 1 + partner + 1)
        assert any(f"rank {r} of {world}: [{expected}, {expected}]" in text for _, text in out), logs
    assert seconds < FAST_S, f"the job took {seconds:.0f} s\n{logs}"


def test_srun_two_tasks(tmp_path):
    out, seconds = start(tmp_path, srun_env(2, 2))
    assert_ran(out, seconds, 2)


def test_mpirun_two_ranks(tmp_path):
    """Open MPI's variables alone on one host: rank 0's address is this host's; MASTER_PORT is given only because
    torch's 29500 may be taken on a shared test machine."""
    out, seconds = start(tmp_path, mpirun_env(2, 2, free_port()))
    assert_ran(out, seconds, 2)


def test_hydra_two_ranks(tmp_path):
    port = free_port()
    envs = [{"PMI_RANK": str(r), "PMI_SIZE": "2", "MPI_LOCALRANKID": str(r), "MPI_LOCALNRANKS": "2",
             "MASTER_PORT": str(port)} for r in range(2)]  # fmt: skip
    out, seconds = start(tmp_path, envs)
    assert_ran(out, seconds, 2)


def test_two_nodes_of_one_task_each_check_their_devices_without_waiting(tmp_path):
    """srun over 2 "nodes" of one task (SLURM_NODEID 0, 1) on the simulated accelerator made exclusive as NCCL is:
    each node's device check waits for its one task only. Before, srun's tasks were not read at all, and a job with
    RANK/WORLD_SIZE but no LOCAL_WORLD_SIZE took the job's 2 ranks for the host's and waited out the init timeout."""
    out, seconds = start(tmp_path, srun_env(2, 1), exclusive=True)
    assert_ran(out, seconds, 2)


def test_a_script_without_local_world_size_checks_every_rank_without_waiting(tmp_path):
    """RANK, WORLD_SIZE, LOCAL_RANK and GROUP_RANK (two nodes) but no LOCAL_WORLD_SIZE, under an exclusive backend:
    every rank posts its device, so the check reads all of them and ends (before: a wait for a second local rank)."""
    port = str(free_port())
    envs = [{"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "GROUP_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": port} for r in range(2)]  # fmt: skip
    out, seconds = start(tmp_path, envs, exclusive=True)
    assert_ran(out, seconds, 2)


def test_mpirun_on_several_hosts_without_master_addr_fails_at_once_on_every_rank(tmp_path):
    out, seconds = start(tmp_path, mpirun_env(4, 2, free_port())[:2], world=4)  # this host's two ranks of four
    for rc, text in out:
        assert rc == 3 and "raised: MASTER_ADDR is not set" in text and "mpirun -x MASTER_ADDR=" in text, text
    assert seconds < FAST_S


@pytest.mark.parametrize("env", [SLURM, OMPI, HYDRA], ids=["srun", "mpirun", "hydra"])
def test_the_trainer_sizes_its_job_from_any_launcher(monkeypatch, env):
    """ParallelTrainingArguments (which makes CPU runs distributed) reads the job's size from the launcher, not
    from WORLD_SIZE alone (unset under srun and mpirun: each rank would think it ran alone, the loss scale 0)."""
    from optimum_parallel.integrations.transformers import training_args

    for name in [*TORCHRUN, *SLURM, *OMPI, *HYDRA]:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert training_args._launched_world_size() == 8
