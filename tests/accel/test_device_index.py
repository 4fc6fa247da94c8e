"""The lane's worker set-up (`_accel._worker`: LOCAL_RANK=rank, its own `init_process_group`, then `init_mesh`) on
a machine with one device: every rank selects device index 0. The simulated device reports one device; here it also
reports itself uninitialised until a device is set, as CUDA does, so torch's `init_device_mesh` would pick
`LOCAL_RANK` itself (`set_device(1)`: "invalid device ordinal" on a one-GPU machine) unless `init_mesh` set the index
first. scripts/device_check.sh runs this lane on one GPU."""

from __future__ import annotations

import pytest
import simulated_neuron
import torch
from _accel import DEVICE, SIMULATED, Workers, install

_SELECTED: list[int] = []


def _one_device_as_cuda_reports_it() -> None:
    """The lane's set-up, every device index selected recorded; on the simulated device the device module also
    answers as CUDA's does on a one-device machine: one device, not initialised until an index is set (on a real
    one-GPU machine it does so itself)."""
    install()
    module = torch.get_device_module(DEVICE)
    set_device, set_index = module.set_device, torch.accelerator.set_device_index

    def record(index, through):
        _SELECTED.append(torch.device(DEVICE, index).index if isinstance(index, int) else torch.device(index).index)
        through(index)

    module.set_device = lambda index: record(index, set_device)
    torch.accelerator.set_device_index = lambda index: record(index, set_index)
    if SIMULATED:
        module.device_count = lambda: 1
        torch.accelerator.device_count = lambda: 1
        module.is_initialized = lambda: bool(_SELECTED)


def _mesh_and_selected() -> dict:
    import os

    import optimum_parallel as op

    selected_before = list(_SELECTED)
    mesh = op.init_mesh(tp=2)
    from optimum_parallel.mesh import device as devices

    x = torch.ones(2, device=devices.collective_device(mesh.group("tp")))  # the GPU, or the CPU under gloo
    torch.distributed.all_reduce(x, group=mesh.group("tp"))
    return {"local_rank": os.environ["LOCAL_RANK"], "before": selected_before, "selected": list(_SELECTED),
            "sum": x.cpu().tolist()}  # fmt: skip


def test_every_rank_selects_index_0_with_one_device():
    assert SIMULATED or DEVICE == "cuda", DEVICE
    workers = Workers(2, setup=_one_device_as_cuda_reports_it)
    try:
        results = workers.run(_mesh_and_selected)
    finally:
        workers.close()
    assert [r["local_rank"] for r in results] == ["0", "1"]
    for r in results:
        assert r["before"] == [] and r["selected"] and set(r["selected"]) == {0}, r
        assert r["sum"] == [2.0, 2.0]
    assert simulated_neuron.NAME == "neuron"


_SHARED_DEVICE_JOB = """
import os, sys
sys.path[:0] = [{accel!r}]
device = {device!r}
if device == "neuron":
    import simulated_neuron
    simulated_neuron.install()
    from optimum_parallel.mesh import device as devices
    devices.EXCLUSIVE_BACKENDS = frozenset({{simulated_neuron.BACKEND}})  # as NCCL: one process per device
else:  # CUDA_VISIBLE_DEVICES: the first GPU for both ranks, whatever the machine has
    os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
import optimum_parallel as op
try:
    op.init_mesh(tp=2, device=device)
except RuntimeError as err:
    os.write(1, f"rank {{os.environ['RANK']}} raised: {{err}}\\n".encode())  # one write: the ranks share the pipe
    sys.exit(3)
print("no error", flush=True)
"""


@pytest.mark.skipif(not SIMULATED and DEVICE != "cuda", reason=f"needs an exclusive backend: NCCL, not {DEVICE}'s")
def test_two_ranks_on_one_device_raise_at_init_mesh_under_an_exclusive_backend(tmp_path):
    """torchrun, 2 ranks, one device: the simulated one with its backend made exclusive as NCCL is, or one GPU under
    NCCL itself; both ranks raise at `init_mesh`, naming both ranks and the device, before any process group
    exists (NCCL's own "Duplicate GPU detected" came from inside the first collective)."""
    import os
    import re
    import subprocess
    import sys

    from _accel import HERE, TESTS

    script = tmp_path / "job.py"
    script.write_text(_SHARED_DEVICE_JOB.format(accel=HERE, device=DEVICE))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([HERE, TESTS, os.path.dirname(TESTS)])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    raised = dict(re.findall(r"rank (\d) raised: ([^\n]*)", done.stdout))
    assert done.returncode != 0 and sorted(raised) == ["0", "1"], done.stdout[-3000:] + done.stderr[-3000:]
    for line in raised.values():
        assert "ranks 0, 1 on" in line and ("neuron:0" if SIMULATED else "cuda ") in line and "one device" in line, line
