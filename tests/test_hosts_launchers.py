"""`srun`- and `mpirun`-style starts across two real network hosts (tests/_hosts.py: two namespaces joined by a veth
pair, 10.77.0.1 and 10.77.0.2): plain processes, two per host, given only one launcher's variables (and MASTER_ADDR
under mpirun, which does not say where rank 0 is), each running `op.init_mesh(tp=2)` and an all-reduce, ended in
seconds. Needs root and iproute2 (skipped with the reason otherwise); run by `make test-hosts`."""

from __future__ import annotations

import os

import pytest
from _hosts import HostsUnavailable, make_hosts
from test_launchers import FAST_S, assert_ran, mpirun_env, srun_env, start

PORT = 29650  # inside the namespaces nothing else listens


@pytest.fixture(scope="module")
def hosts():
    try:
        hosts = make_hosts(f"op{os.getpid() % 100000}l")
    except HostsUnavailable as err:
        pytest.skip(f"cannot make two network hosts on this machine: {err}")
    yield hosts
    hosts.destroy()


def _on_hosts(hosts, per_host: int) -> list[list[str]]:
    """Each rank's command prefix: its host's namespace, gloo told the host's interface (namespaces share a name)."""
    return [
        ["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={dev}"]
        for ns, dev in zip(hosts.namespaces, hosts.interfaces, strict=True)
        for _ in range(per_host)
    ]


def test_srun_over_two_hosts(hosts, tmp_path):
    """srun -N 2 --ntasks-per-node 2: rank 0's host from the node list, the port from the job id."""
    envs = srun_env(4, 2, port_job=PORT - 20000, nodelist=f"{hosts.addresses[0][:-1]}[1-2]")
    out, seconds = start(tmp_path, envs, prefixes=_on_hosts(hosts, 2))
    assert_ran(out, seconds, 4)


def test_mpirun_over_two_hosts(hosts, tmp_path):
    out, seconds = start(tmp_path, mpirun_env(4, 2, PORT + 1, addr=hosts.addresses[0]), prefixes=_on_hosts(hosts, 2))
    assert_ran(out, seconds, 4)


def test_one_task_per_host_checks_its_device_without_waiting(hosts, tmp_path):
    """One task a host on the simulated accelerator made exclusive as NCCL is: each host's device check waits for
    its own task only (SLURM_NODEID tells the hosts apart: the namespaces share one host name)."""
    envs = srun_env(2, 1, port_job=PORT + 2 - 20000, nodelist=f"{hosts.addresses[0][:-1]}[1-2]")
    out, seconds = start(tmp_path, envs, exclusive=True, prefixes=_on_hosts(hosts, 1))
    assert_ran(out, seconds, 2)
    assert seconds < FAST_S
