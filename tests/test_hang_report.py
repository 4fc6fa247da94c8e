"""A rank stuck outside a collective for longer than the mesh timeout: every survivor prints one line naming the
collective it waited in, its group and the missing ranks (optimum_parallel/mesh/hang_report.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

JOB = Path(__file__).parent / "_hang_job.py"


def test_every_survivor_names_the_collective_the_group_and_the_missing_rank():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(JOB.parent.parent)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", str(JOB)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0
    lines = re.findall(r"^\[optimum-parallel\] rank (\d): (.*)$", result.stdout + result.stderr, re.MULTILINE)
    by_rank = {int(rank): line for rank, line in lines}
    output = result.stdout + result.stderr
    assert sorted(by_rank) == [0, 1, 2] and len(lines) == 3, "\n".join(t for t in output.splitlines() if t[:1] != " ")
    # rank 2 waited for 3 in tp, rank 1 for 3 in dp, rank 0 for 2 in dp (which itself waited for 3)
    assert by_rank[2].startswith("all_reduce on the tp group (ranks 2, 3) failed (Timed out"), by_rank[2]
    assert by_rank[1].startswith("all_reduce on the dp group (ranks 1, 3) failed"), by_rank[1]
    assert by_rank[0].startswith("all_reduce on the dp group (ranks 0, 2) failed"), by_rank[0]
    assert "missing in that group: 3;" in by_rank[2] and "missing in that group: 3;" in by_rank[1]
    assert "missing in that group: none;" in by_rank[0]
    for line in by_rank.values():
        assert line.endswith("(stuck elsewhere or dead): 3"), line
