"""The full 3-D mesh: dp=2 x pp=2 x tp=2 on 8 gloo processes (a pool of its own: 8 ranks start slowly on 2 cores)."""

from __future__ import annotations

import pytest
from _checks import TOL
from test_pipeline import check_pipeline

WORLD_SIZE = 8  # worker processes of this module's `pool` (conftest.py)


@pytest.mark.parametrize("sharding_level", [1, 3])
def test_dp_pp_tp_matches_single_device(pool, sharding_level):
    """3 AdamW steps; ZeRO-1 (level 1) and FSDP2 (level 3) over dp on top of pipeline and tensor parallelism."""
    results = pool.run(check_pipeline, pp=2, tp=2, sharding_level=sharding_level)
    for rank, result in enumerate(results):
        assert result["loss"] <= TOL and result["worst_grad"] <= TOL, f"rank {rank}: {result}"
