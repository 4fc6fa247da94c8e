"""Slow is not dead, in every phase (optimum_parallel/mesh/heartbeat.py): ParallelTrainer jobs at tp=2 on one host
(`torchrun --standalone`, `_heartbeat_job.py`, the package's defaults unless a case says otherwise).

- A rank SIGKILLed or SIGSTOPped (frozen, threads and all) while loading (before parallelize), in steady training,
  inside a checkpoint save and in the evaluation loop: the job ends (torchrun exits non-zero) under 60 s after the
  fault, and the output names the rank (the heartbeat's line for a frozen one, torchrun's summary for a killed one).
- A rank alive but minutes late -- 180 s in an `on_evaluate` callback, 180 s inside the save's exchange, both with the
  defaults; 60 s in an `on_save` callback with a 5 s dead-after -- is waited for: the job trains to the end; and a
  rank still at work 40 s after the other one exited cleanly is left to finish.

Every job starts at once when the module starts (one wall-clock wait: the module takes about as long as its slowest
case, the 180 s ones); each test waits for its own. Settings errors are checked in-process.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _models import build_model, tiny_config

from optimum_parallel.mesh.heartbeat import ENV_DEAD_AFTER, ENV_INTERVAL, HeartbeatSettings

JOB = str(Path(__file__).parent / "_heartbeat_job.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}
for _name in (ENV_INTERVAL, ENV_DEAD_AFTER, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
    ENV.pop(_name, None)  # the defaults
ENDS_WITHIN_S = 60
SHORT = {ENV_INTERVAL: "1", ENV_DEAD_AFTER: "5"}

# name -> (FAULT for _heartbeat_job.py, extra environment)
DEAD = {
    f"{what}-{where}": (f"{what}:{where}:{rank}", {})
    for what, ranks in (("kill", (1, 0, 1, 0)), ("stop", (1, 0, 1, 0)))
    for where, rank in zip(("load", "train", "save", "evaluate"), ranks, strict=True)
}
# what the report line says of the survivor's (or the frozen rank's last) phase, by the place of the fault
REPORTED_PHASE = {"save": "save", "evaluate": "evaluation", "train": "step 4", "load": "before the first"}
SLOW = {
    "late-on_evaluate-defaults": ("sleep:on_evaluate:0:180", {}),
    "late-in-save-defaults": ("sleep:save:1:180", {}),
    "late-on_save-short": ("sleep:on_save:0:60", SHORT),
    "late-alone-after-training-defaults": ("sleep:end:0:40", {}),  # rank 1 has exited cleanly: not a dead rank
}


class Job:
    """One torchrun job of `_heartbeat_job.py`, in its own session (so a frozen worker can be cleaned up)."""

    def __init__(self, name: str, hf_dir: str, out: Path, fault: str, env: dict) -> None:
        self.name, self.out = name, out
        out.mkdir(parents=True)
        self.log = out / "torchrun.log"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        with open(self.log, "w") as log:
            self.agent = subprocess.Popen(
                [*command, JOB, hf_dir, str(out)],
                env={**ENV, **env, "FAULT": fault},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.ended: float | None = None

    def poll(self) -> bool:
        """Whether the job ended (its end time noted when first seen)."""
        if self.ended is None and self.agent.poll() is not None:
            self.ended = time.time()
        return self.ended is not None

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while not self.poll():
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"{self.name} did not end within {timeout:.0f} s:\n{self.output()}")
            time.sleep(0.2)
        return self.agent.returncode

    def fault_time(self) -> float:
        faults = list(self.out.glob("fault-rank*"))
        assert len(faults) == 1, f"{self.name}: the fault never happened\n{self.output()}"
        return float(faults[0].read_text())

    def done(self) -> list[str]:
        return sorted(p.name for p in self.out.glob("done-rank*"))

    def output(self, tail: int = 4000) -> str:
        return self.log.read_text()[-tail:]

    def kill(self) -> None:
        """The agent's session, and the workers' (torchrun starts each in a session of its own: a frozen one would
        outlive its killed agent), where their command line still names this job."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.agent.pid, signal.SIGKILL)
        self.agent.wait()
        for pid_file in self.out.glob("pid-rank*"):
            pid = int(pid_file.read_text())
            with contextlib.suppress(OSError):
                if str(self.out).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.killpg(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    hf_dir = tmp_path_factory.mktemp("hf") / "llama"
    build_model(tiny_config("llama"), seed=7).save_pretrained(hf_dir)
    root = tmp_path_factory.mktemp("jobs")
    started = {name: Job(name, str(hf_dir), root / name, fault, env) for name, (fault, env) in {**SLOW, **DEAD}.items()}
    watching = threading.Event()

    def watch() -> None:  # every job's end time, as it happens (the tests wait for them one by one)
        while not watching.wait(0.2):
            for job in started.values():
                job.poll()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    yield started
    watching.set()
    watcher.join()
    for job in started.values():
        job.kill()  # anything left (a failed test), with its frozen workers


@pytest.mark.parametrize("name", sorted(DEAD))
def test_dead_or_frozen_rank_ends_the_job_within_a_minute(jobs, name):
    job = jobs[name]
    code = job.wait(300)
    took = job.ended - job.fault_time()
    print(f"{name}: the job ended {took:.1f} s after the fault (exit code {code})")
    output = job.output(20000)
    assert code != 0 and not job.done(), output[-4000:]
    assert took < ENDS_WITHIN_S, (took, output[-4000:])
    what, where, rank = DEAD[name][0].split(":")
    if what == "kill":  # torchrun sees the death at once and names it
        assert re.search(rf"rank\s*: {rank} \(local_rank: {rank}\)\s*exitcode\s*: -9", output), output[-4000:]
        return
    line = re.search(
        rf"^\[optimum-parallel\] heartbeat on rank \d: (rank 0 found )?rank {rank} has not beaten.*$", output, re.M
    )
    assert line, output[-4000:]
    assert REPORTED_PHASE[where] in line.group(0), line.group(0)


@pytest.mark.parametrize("name", sorted(SLOW))
def test_slow_rank_is_waited_for(jobs, name):
    job = jobs[name]
    code = job.wait(420)
    late = float(SLOW[name][0].rsplit(":", 1)[1])
    print(f"{name}: {late:.0f} s late, the job ended normally {job.ended - job.fault_time():.1f} s after the fault")
    assert code == 0 and job.done() == ["done-rank0", "done-rank1"], job.output()
    assert job.ended - job.fault_time() >= late
    assert "heartbeat on rank" not in job.output(20000)


@pytest.mark.parametrize(
    ("env", "kwargs", "message"),
    [
        ({ENV_INTERVAL: "abc"}, {}, f"{ENV_INTERVAL}='abc' is not a number"),
        ({ENV_INTERVAL: "-1"}, {}, f"{ENV_INTERVAL}='-1'; allowed"),
        ({ENV_DEAD_AFTER: "0"}, {}, f"{ENV_DEAD_AFTER}='0'; allowed: seconds, a number > 0"),
        ({}, {"interval": 5, "dead_after": 6}, "heartbeat_dead_after=6 .* shorter than twice"),
        ({}, {"dead_after": float("inf")}, "heartbeat_dead_after=inf"),
        ({}, {"interval": "2"}, "heartbeat_interval='2' is not a number"),
        ({}, {"interval": True}, "heartbeat_interval=True is not a number"),
    ],
)
def test_bad_settings_raise_naming_the_key(monkeypatch, env, kwargs, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        HeartbeatSettings.of(**kwargs)


def test_settings_from_arguments_environment_and_defaults(monkeypatch):
    assert HeartbeatSettings.of() == HeartbeatSettings(2.0, 15.0)
    monkeypatch.setenv(ENV_INTERVAL, "1")
    monkeypatch.setenv(ENV_DEAD_AFTER, "4")
    assert HeartbeatSettings.of() == HeartbeatSettings(1.0, 4.0)
    assert HeartbeatSettings.of(interval=0.5, dead_after=3) == HeartbeatSettings(0.5, 3.0)  # arguments win
    monkeypatch.setenv(ENV_INTERVAL, "0")
    assert not HeartbeatSettings.of().on


def test_init_mesh_rejects_bad_settings_before_starting_anything():
    import torch.distributed as dist

    import optimum_parallel as op

    with pytest.raises(ValueError, match="heartbeat_dead_after=1"):
        op.init_mesh(tp=1, heartbeat_interval=2, heartbeat_dead_after=1)
    assert not dist.is_initialized()
