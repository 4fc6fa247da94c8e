"""The default group the package made is destroyed at a clean exit, before Python finalizes (mesh/clean_exit.py),
and left alone after an uncaught exception (a rank that failed must end at once, not join a collective that waits on
a peer); a destroy that blocks (NCCL work queued to a dead peer) holds the exit at most `DESTROY_WAIT_S`. One
process each, gloo over a world of one: what runs at exit is read by an exit hook registered before
the package's, which runs after it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from optimum_parallel.mesh.ports import free_port

SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    import torch.distributed as dist
    atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
    import optimum_parallel as op
    mesh = op.init_mesh(tp=1, timeout=30)
    out = [None]
    dist.all_gather_object(out, "x")  # a collective just before the end, as a Trainer's last metrics
    if sys.argv[1] == "raise":
        raise RuntimeError("this rank failed")
    if sys.argv[1] == "stuck":
        import time
        dist.destroy_process_group = lambda: time.sleep(600)
    """
)


@pytest.mark.parametrize(
    ("how", "initialized", "returncode"), [("clean", False, 0), ("raise", True, 1), ("stuck", True, 0)]
)
def test_default_group_destroyed_only_at_a_clean_exit(tmp_path, how, initialized, returncode):
    port = free_port()  # for this process's store
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, how], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == returncode, done.stderr[-2000:]
    assert f"initialized at exit: {initialized}" in done.stdout, done.stdout + done.stderr[-2000:]
    if how == "stuck":  # out after the bounded wait, not the 600 s the destroy would take
        assert "did not return within 5 s" in done.stderr and time.monotonic() - started < 60, done.stderr[-2000:]
