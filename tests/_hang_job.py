"""A 4-rank dp=2 x tp=2 job whose rank 3 gets stuck outside any collective (tests/test_hang_report.py)."""

import time

import torch
import torch.distributed as dist

import optimum_parallel as op

mesh = op.init_mesh(dp=2, tp=2, timeout=5)
rank = dist.get_rank()
tensor = torch.ones(8)
for step in range(3):
    if rank == 3 and step == 1:
        time.sleep(40)  # stuck outside any collective, longer than the timeout
    dist.all_reduce(tensor, group=mesh.group("tp"))
    dist.all_reduce(tensor, group=mesh.group("dp"))
