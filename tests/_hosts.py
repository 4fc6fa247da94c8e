"""Two real network hosts on one machine: Linux network namespaces joined by a veth pair (10.77.0.1 <-> 10.77.0.2).

Each host runs its own `torchrun --nnodes 2 --rdzv-backend c10d` agent on its own address; nothing leaves the
machine (`TORCH_DISABLE_SHARE_RDZV_TCP_STORE` unset, see AGENT_ENV). Namespaces share the machine's hostname, so
the agents name their address (`--local-addr`), the first one hosts the rendezvous store
(`--rdzv-conf is_host=true`), and gloo is told its interface (`GLOO_SOCKET_IFNAME`). Needs root and iproute2
(`ip`); `make_hosts` raises `HostsUnavailable` with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
SUBNET = "10.77.0"
_ports = itertools.count(29600)
# torchrun's agents share their rendezvous store with the workers by default, and it outlives a restart
# (`--max-restarts`) with the previous attempt's keys; `init_mesh` / `ParallelTrainingArguments` form each attempt's
# group on a store of its own (optimum_parallel/mesh/rendezvous.py), so the agents run without
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (which a user could forget): it is unset here.
AGENT_ENV = ["-u", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]


class HostsUnavailable(RuntimeError):
    pass


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode:
        raise HostsUnavailable(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")


@dataclass
class Job:
    """One multi-host torchrun job: an agent per host."""

    agents: list[subprocess.Popen]
    logs: list[Path]
    started: float = field(default_factory=time.monotonic)

    def wait(self, timeout: float = 240) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for agent in self.agents:
            try:
                codes.append(agent.wait(max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"the job did not end in {timeout} s:\n{self.output()}") from None
        return codes

    def kill(self) -> None:
        for agent in self.agents:
            if agent.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()

    def output(self, tail: int = 4000) -> str:
        """Each host's log, its C++ stack frames left out (they would push the error itself out of the tail)."""
        logs = (_without_frames(log.read_text()) for log in self.logs)
        return "\n".join(f"--- host {i}:\n{text[-tail:]}" for i, text in enumerate(logs))


def _without_frames(text: str) -> str:
    frame = re.compile(r"\s*(frame #\d+:|<omitting python frames>)")
    return "\n".join(line for line in text.splitlines() if not frame.match(line))


class Hosts:
    """Two namespaces `<name>0` / `<name>1` with addresses 10.77.0.1 / 10.77.0.2."""

    def __init__(self, name: str) -> None:
        self.namespaces = [f"{name}{i}" for i in range(2)]
        self.interfaces = [f"{name}v{i}" for i in range(2)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(2)]

    def create(self) -> None:
        if shutil.which("ip") is None:
            raise HostsUnavailable("iproute2's `ip` is not installed")
        if os.geteuid() != 0:
            raise HostsUnavailable("network namespaces need root")
        try:
            for ns in self.namespaces:
                _ip("netns", "add", ns)
            _ip("link", "add", self.interfaces[0], "type", "veth", "peer", "name", self.interfaces[1])
            for ns, dev, addr in zip(self.namespaces, self.interfaces, self.addresses, strict=True):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", dev, "up")
        except HostsUnavailable:
            self.destroy()
            raise

    def destroy(self) -> None:
        for ns in self.namespaces:  # deleting a namespace deletes its end of the veth pair, and with it the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def torchrun(self, script: list[str], env: dict, logs: Path, nproc: int = 2, extra: tuple[str, ...] = ()) -> Job:
        """Start the same `torchrun --nnodes 2` command on both hosts (the first hosts the rendezvous)."""
        port, job_id = next(_ports), f"job{time.monotonic_ns()}"
        agents, files = [], []
        logs.mkdir(parents=True, exist_ok=True)
        for i, (ns, dev, addr) in enumerate(zip(self.namespaces, self.interfaces, self.addresses, strict=True)):
            command = ["ip", "netns", "exec", ns, "env", *AGENT_ENV, f"GLOO_SOCKET_IFNAME={dev}", *TORCHRUN]
            command += ["--nnodes", "2", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d"]
            command += ["--rdzv-endpoint", f"{self.addresses[0]}:{port}", "--rdzv-id", job_id]
            command += ["--rdzv-conf", f"is_host={'true' if i == 0 else 'false'}", "--local-addr", addr, *extra]
            log = logs / f"host{i}.log"
            files.append(log)
            with open(log, "w") as f:
                agents.append(
                    subprocess.Popen(
                        command + script, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
        return Job(agents, files)


def make_hosts(name: str) -> Hosts:
    hosts = Hosts(name)
    hosts.create()
    return hosts
