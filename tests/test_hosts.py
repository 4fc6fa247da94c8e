"""Several hosts on one machine (network namespaces joined by a veth pair, one torchrun agent per host, c10d
rendezvous): two hosts x 2 ranks train the same losses and write the same checkpoint files, byte for byte, as one
host of 4 ranks (dp=2 x tp=2, pp=2 x tp=2, ParallelTrainer); a lost host ends the job within the mesh timeout and
`torchrun --max-restarts 1` brings it back from the last complete checkpoint to the same final weights, bit for bit;
a rank of either host SIGKILLed inside a sharded save leaves the previous checkpoint complete, byte for byte.
On one machine (`torchrun --standalone --max-restarts 1`, no namespaces needed): a ParallelTrainer job at tp=2 with a
rank SIGKILLed at step 5 of 8 restarts and ends bit-identical, 5 runs in 5, and so does one killed inside an async
save's background write; all of it with TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset.
With the mesh's default timeouts (mesh/timeouts.py, `_host_slow.py`): a rank 75 s late before `parallelize` (one
host) and 75 s late inside a save (two hosts) train to the end; a SIGKILLed rank ends the job in under 90 s, on one
host and across two, in steady state and inside a save (where the 10-minute init timeout is on).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from _hosts import TORCHRUN, HostsUnavailable, make_hosts
from _models import build_model, tiny_config

SCRIPT = str(Path(__file__).parent / "_host_train.py")
SLOW_SCRIPT = str(Path(__file__).parent / "_host_slow.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}
ENV.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # restarts work without it (optimum_parallel/mesh/rendezvous.py)
STEPS, SAVE_EVERY = 4, 2
CHECKPOINTS = [f"checkpoint-{s}" for s in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)] + ["final"]
LAYOUTS = {"dp2-tp2": ["--dp", "2", "--tp", "2"], "pp2-tp2": ["--pp", "2", "--tp", "2"]}


@pytest.fixture(scope="module")
def hosts():
    try:
        hosts = make_hosts(f"op{os.getpid() % 100000}h")
    except HostsUnavailable as err:
        pytest.skip(f"cannot make two network hosts on this machine: {err}")
    yield hosts
    hosts.destroy()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("hf") / "llama"
    build_model(tiny_config("llama"), seed=7).save_pretrained(path)
    return str(path)


def _args(hf_dir: str, out: Path, layout: str, *extra: str) -> list[str]:
    return [SCRIPT, hf_dir, str(out), *LAYOUTS[layout], "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), *extra]


def one_host(hf_dir: str, out: Path, layout: str, *extra: str) -> Path:
    command = [*TORCHRUN, "--standalone", "--nproc-per-node", "4", *_args(hf_dir, out, layout, *extra)]
    result = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def two_hosts(hosts, hf_dir: str, out: Path, layout: str, *extra: str, env=None, torchrun=()) -> Path:
    job = hosts.torchrun(_args(hf_dir, out, layout, *extra), {**ENV, **(env or {})}, out / "logs", extra=torchrun)
    codes = job.wait()
    assert codes == [0, 0], job.output()
    return out


def _losses(out: Path) -> dict[int, list[float]]:
    """Each rank's losses (one file per rank: only an attempt that finished writes one)."""
    files = sorted(out.glob("losses-rank*-attempt*.json"))
    losses = {int(p.name.split("-")[1][4:]): json.loads(p.read_text()) for p in files}
    assert len(losses) == len(files) == 4, [p.name for p in files]
    return losses


def _files(directory: Path) -> dict[str, bytes]:
    """Every file of a checkpoint but the Trainer's pickled arguments (they hold the output path) and the ranks'
    generator states (`rng-*.pt`: the custom loop does not seed, and torch seeds every process at random)."""
    return {
        p.name: p.read_bytes()
        for p in sorted(directory.iterdir())
        if p.is_file() and p.suffix != ".bin" and not p.name.startswith("rng-")
    }


def _assert_same_checkpoints(a: Path, b: Path, names: list[str]) -> None:
    for name in names:
        files_a, files_b = _files(a / name), _files(b / name)
        assert files_a.keys() == files_b.keys(), name
        different = [f for f in files_a if files_a[f] != files_b[f]]
        assert not different, f"{name}: {different} differ"


@pytest.fixture(scope="module")
def reference(hf_dir, tmp_path_factory):
    """One host of 4 ranks, per layout (run once, on first use)."""
    runs: dict[str, Path] = {}

    def get(layout: str) -> Path:
        if layout not in runs:
            extra = ("--trainer",) if layout.endswith("trainer") else ()
            runs[layout] = one_host(hf_dir, tmp_path_factory.mktemp(layout), layout.split("+")[0], *extra)
        return runs[layout]

    return get


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_hosts_equal_one_host(hosts, hf_dir, reference, tmp_path, layout):
    out = two_hosts(hosts, hf_dir, tmp_path / "two", layout)
    one = reference(layout)
    assert _losses(out) == _losses(one) and len(_losses(one)[0]) == STEPS
    _assert_same_checkpoints(out, one, CHECKPOINTS)


def test_two_hosts_equal_one_host_with_trainer(hosts, hf_dir, reference, tmp_path):
    out = two_hosts(hosts, hf_dir, tmp_path / "two", "dp2-tp2", "--trainer")
    one = reference("dp2-tp2+trainer")
    assert _losses(out) == _losses(one) and len(_losses(one)[0]) == STEPS
    _assert_same_checkpoints(out, one, CHECKPOINTS)


@pytest.mark.parametrize("trainer", [False, True], ids=["custom-loop", "trainer"])
def test_lost_host_restarts_from_last_checkpoint(hosts, hf_dir, reference, tmp_path, trainer):
    """SIGKILL the second host's ranks after step 3 (checkpoint-2 is the last): the first host's ranks fail within
    the mesh timeout (30 s), torchrun restarts both hosts once, the job resumes from checkpoint-2 by itself and ends
    with the final weights of the run that was never interrupted."""
    extra = ("--trainer",) if trainer else ()
    out = tmp_path / "lost"
    env = {"KILL_HOST_AT_STEP": "3", "KILL_HOST_IFNAME": hosts.interfaces[1]}
    two_hosts(hosts, hf_dir, out, "dp2-tp2", *extra, env=env, torchrun=("--max-restarts", "1"))
    killed = [float(p.read_text()) for p in out.glob("killed-rank*")]
    failed = [json.loads(p.read_text()) for p in out.glob("failed-rank*")]
    assert len(killed) == 2 and len(failed) == 2, (killed, failed)
    assert all(f["time"] - max(killed) < 30 for f in failed), (killed, failed)
    one = reference("dp2-tp2+trainer" if trainer else "dp2-tp2")
    resumed = {rank: losses[-(STEPS - 2) :] for rank, losses in _losses(one).items()}  # steps 3 and 4 again
    assert _losses(out) == resumed
    _assert_same_checkpoints(out, one, ["final"])


# ----------------------------------------------------------------------------------------------- one machine, restarts

RESTART_STEPS = ["--tp", "2", "--steps", "8", "--save-every", "2", "--trainer"]


def standalone(hf_dir: str, out: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`torchrun --standalone --max-restarts 1 --nproc-per-node 2` of the ParallelTrainer job (tp=2, 8 steps,
    save_steps=2, resuming from the last complete checkpoint when there is one)."""
    command = [*TORCHRUN, "--standalone", "--max-restarts", "1", "--nproc-per-node", "2", SCRIPT, hf_dir, str(out)]
    result = subprocess.run(
        command + RESTART_STEPS + list(extra), env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def uninterrupted_tp2(hf_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted-tp2")
    standalone(hf_dir, out)
    return out


def _assert_resumed_from(out: Path, reference: Path, step: int, result: subprocess.CompletedProcess) -> None:
    """The first attempt died (rank 1 SIGKILLed), the second resumed from checkpoint-<step> and ended bit-identical.
    The death shows as the marker the job writes before killing itself, the other rank's failure file, or
    torchrun's restart warning naming local rank 1's exit code -9 (a kill inside a save, where rank 0 may be torn
    down before it can write its file)."""
    killed = re.search(r"failed \(exitcode: -9\) local_rank: 1 ", result.stdout + result.stderr)
    marked = (out / "killed-rank1").exists() or list(out.glob("failed-rank*-attempt0"))
    assert marked or killed, (sorted(os.listdir(out)), result.stderr[-3000:])
    losses = {p.name: json.loads(p.read_text()) for p in sorted(out.glob("losses-rank*-attempt1.json"))}
    expected = json.loads((reference / "losses-rank0-attempt0.json").read_text())[step:]
    assert len(losses) == 2 and all(v == expected for v in losses.values()), (losses, expected)
    _assert_same_checkpoints(out, reference, ["final", "checkpoint-8"])


@pytest.mark.parametrize("run", range(5))
def test_restart_on_one_machine_needs_no_variable(hf_dir, uninterrupted_tp2, tmp_path, run):
    """The job of the issue: rank 1 SIGKILLed after step 5 of 8; the restarted attempt forms its groups (no gloo
    connect timeout), resumes from checkpoint-4 and ends with the uninterrupted run's weights, bit for bit."""
    out = tmp_path / "restarted"
    result = standalone(hf_dir, out, env={"KILL_RANK_AT_STEP": "1:5"})
    _assert_resumed_from(out, uninterrupted_tp2, 4, result)


def test_killed_during_async_save_restarts_from_last_complete(hf_dir, uninterrupted_tp2, tmp_path):
    """async_save=True: rank 1 SIGKILLed inside the background write of checkpoint-6 (its 5th tensor) while rank 0
    trains on; the restart skips the partial checkpoint-6, resumes from checkpoint-4, and ends bit-identical."""
    out = tmp_path / "async"
    env = {"CRASH_IN_SAVE": "tensor:5@1", "CRASH_IN_SAVE_STEP": "6"}
    result = standalone(hf_dir, out, "--async-save", env=env)
    assert "async save of" in result.stdout, result.stdout[-2000:]
    _assert_resumed_from(out, uninterrupted_tp2, 4, result)


# (layout, crash point "name:n" in the save of checkpoint-4, the rank that dies): host 0 holds ranks 0-1, host 1
# ranks 2-3. Under pp2-tp2 each host writes its stage's files; under dp2-tp2 only host 0 writes and host 1's ranks
# die in the save's collectives ("gather:k": the k-th result exchange; 1 describe, 2 prepare, 3 write, 4 after
# rank 0 published, so a death there still leaves checkpoint-4 complete).
PUBLISHED = ("published:1", "gather:4")
CRASHES = [
    ("pp2-tp2", "gather:1", 2),
    ("pp2-tp2", "prepare:1", 0),
    ("pp2-tp2", "gather:2", 3),
    ("pp2-tp2", "tensor:1", 2),
    ("pp2-tp2", "tensor:7", 3),
    ("pp2-tp2", "tensor:2", 0),
    ("pp2-tp2", "file:1", 2),
    ("pp2-tp2", "tensor:15", 1),
    ("pp2-tp2", "file:2", 3),
    ("pp2-tp2", "gather:3", 2),
    ("pp2-tp2", "config:1", 0),
    ("pp2-tp2", "index:1", 0),
    ("pp2-tp2", "publish:1", 0),
    ("pp2-tp2", "published:1", 0),
    ("dp2-tp2", "gather:1", 3),
    ("dp2-tp2", "tensor:5", 1),
    ("dp2-tp2", "gather:3", 2),
    ("dp2-tp2", "file:2", 0),
    ("dp2-tp2", "gather:4", 3),
    ("dp2-tp2", "published:1", 0),
]


@pytest.mark.parametrize(("layout", "point", "rank"), CRASHES, ids=[f"{lay}-{p}@rank{r}" for lay, p, r in CRASHES])
def test_crash_while_saving_across_hosts(hosts, hf_dir, reference, tmp_path, layout, point, rank):
    """The found checkpoint is the last complete one (checkpoint-2, or checkpoint-4 once renamed into place), it
    verifies and equals the uninterrupted run's files, and the interrupted save is named in a warning."""
    from optimum_parallel.checkpoint import find_last_checkpoint, verify_checkpoint

    out = tmp_path / "crash"
    args = _args(hf_dir, out, layout, "--timeout", "15")  # the other host's ranks wait out the timeout
    job = hosts.torchrun(args, {**ENV, "CRASH_IN_SAVE": f"{point}@{rank}"}, out / "logs")
    codes = job.wait()
    log = job.logs[rank // 2].read_text()
    killed = re.search(rf"rank\s*: {rank} \(local_rank: {rank % 2}\)\s*exitcode\s*: -9 ", log)
    assert codes[rank // 2] != 0 and killed, f"rank {rank} never reached {point}:\n{job.output()}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        last = find_last_checkpoint(out)
    messages = [str(w.message) for w in caught]
    expected = "checkpoint-4" if point in PUBLISHED else "checkpoint-2"
    assert last is not None and last.name == expected, (last, messages, job.output())
    verify_checkpoint(last)
    assert _files(last) == _files(reference(layout) / expected), "differs from an uninterrupted run"
    for partial in (p.name for p in out.iterdir() if p.name.endswith(".partial")):
        assert any(partial in m and "interrupted" in m for m in messages), (partial, messages)


# ------------------------------------------------------------------- default timeouts: slow is not dead, dead is found
LATE_S = 75  # longer than the 60 s every group waited before the init/train timeouts
DEAD_WITHIN_S = 90


@pytest.fixture(scope="module")
def maybe_hosts(request):
    """The two hosts, or None where this machine cannot make them (the one-host jobs still run)."""
    try:
        return request.getfixturevalue("hosts")
    except pytest.skip.Exception:
        return None


class _Run:
    """One `_host_slow.py` job (one host: `torchrun --standalone`; two: `Hosts.torchrun`), watched until it ends."""

    def __init__(self, name: str, out: Path, hf_dir: str, env: dict, hosts=None, layout=("--tp", "2")) -> None:
        self.name, self.out = name, out
        out.mkdir(parents=True)
        args = [SLOW_SCRIPT, hf_dir, str(out), *layout]
        if hosts is None:
            log = out / "torchrun.log"
            command = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", *args]
            with open(log, "w") as f:
                self.agents = [
                    subprocess.Popen(
                        command, env={**ENV, **env}, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
                    )
                ]
            self.logs = [log]
        else:
            job = hosts.torchrun(args, {**ENV, **env}, out / "logs")
            self.agents, self.logs = job.agents, job.logs
        self.ended: float | None = None

    def poll(self) -> bool:
        if self.ended is None and all(a.poll() is not None for a in self.agents):
            self.ended = time.time()
        return self.ended is not None

    def codes(self) -> list[int | None]:
        return [a.returncode for a in self.agents]

    def output(self, tail: int = 3000) -> str:
        return "\n".join(f"--- {self.name} {log.name}:\n{log.read_text()[-tail:]}" for log in self.logs)

    def files(self, prefix: str) -> dict[int, str]:
        return {int(p.name.rpartition("rank")[2]): p.read_text() for p in self.out.glob(f"{prefix}-rank*")}

    def kill(self) -> None:
        for agent in self.agents:
            if agent.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()


def _wait_all(runs: list[_Run], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(r.poll() for r in runs):
        if time.monotonic() > deadline:
            for r in runs:
                r.kill()
            raise AssertionError("jobs did not end in time:\n" + "\n".join(r.output() for r in runs))
        time.sleep(0.2)


def test_late_rank_passes_with_default_timeouts(maybe_hosts, hf_dir, tmp_path):
    """Both at once (one wall-clock wait): rank 1 of a tp=2 job 75 s late before parallelize (one host), and rank 3
    of a dp=2 x tp=2 job 75 s late inside the checkpoint save after step 2 (two hosts; one host without them)."""
    runs = [_Run("late-before-parallelize", tmp_path / "a", hf_dir, {"LATE": f"parallelize:1:{LATE_S}"})]
    if maybe_hosts is not None:
        late = {"LATE": f"save:3:{LATE_S}"}
        runs.append(_Run("late-in-save", tmp_path / "b", hf_dir, late, maybe_hosts, ("--dp", "2", "--tp", "2")))
    else:  # on one host: tp=2
        runs.append(_Run("late-in-save", tmp_path / "b", hf_dir, {"LATE": f"save:1:{LATE_S}"}))
    _wait_all(runs, 300)
    for run in runs:
        assert all(code == 0 for code in run.codes()), run.output()
        done = {r: json.loads(v) for r, v in run.files("done").items()}
        assert len(done) == (4 if run.name == "late-in-save" and maybe_hosts else 2), run.output()
        assert not run.files("failed"), run.output()
        assert [float(s) >= LATE_S for s in run.files("late").values()] == [True], run.output()  # it was late
        losses = {tuple(d["losses"]) for d in done.values()}  # one per dp rank (its rows), the same at every tp rank
        assert len(losses) == (2 if len(done) == 4 else 1) and all(len(x) == 3 for x in losses), done


def test_killed_rank_ends_the_job_fast_with_default_timeouts(maybe_hosts, hf_dir, tmp_path):
    """At once: rank 1 of a tp=2 job SIGKILLed after step 1 (one host), rank 2 of a dp=2 x tp=2 job after step 1
    (two hosts: the others wait with the train timeout, 2 minutes) and rank 3 of another inside its save (two hosts:
    the init timeout, 10 minutes, is on then); each job ends (its torchrun agents exit non-zero) under 90 s after
    the kill: gloo sees the dead rank's connections close, the survivors' hang report names who is missing, and
    torchrun ends the rest."""
    runs = [_Run("one-host-step", tmp_path / "c", hf_dir, {"KILL": "step:1"})]
    if maybe_hosts is not None:
        layout = ("--dp", "2", "--tp", "2")
        runs.append(_Run("two-hosts-step", tmp_path / "d", hf_dir, {"KILL": "step:2"}, maybe_hosts, layout))
        runs.append(_Run("two-hosts-save", tmp_path / "e", hf_dir, {"KILL": "save:3"}, maybe_hosts, layout))
    _wait_all(runs, 300)
    took = {}
    for run in runs:
        killed = run.files("killed")
        assert len(killed) == 1 and all(code != 0 for code in run.codes()), run.output()
        took[run.name] = run.ended - float(next(iter(killed.values())))
    print(f"job end after the kill (s): {took}")
    reports = "".join(log.read_text() for run in runs for log in run.logs)
    assert "[optimum-parallel] rank" in reports and "failed (" in reports, reports[-3000:]
    assert all(0 < s < DEAD_WITHIN_S for s in took.values()), (took, [r.output() for r in runs])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
