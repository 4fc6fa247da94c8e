"""ParallelRLOOTrainer at dp=2 x tp=2, sharding level 3 (FSDP2) (gloo, 4 ranks) logs, step by step and in the evaluation
after step 3, every figure TRL's RLOOTrainer logs on one process with the same global batch (completions fixed by the
prompt and its place in the generation batch). Each replica holds 6 of the 12 completions, so the second prompt's
group of 4 straddles the replicas: its leave-one-out baselines need the rewards (and the kl) of both, gathered over
the replicas only."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from _dpo import check_against, noise_floor, perturbed_copy  # noqa: E402
from _grpo import save_tiny_llama  # noqa: E402
from _rloo import train_parallel, trl_reference  # noqa: E402

WORLD_SIZE = 4
TOL = 1e-5  # relative, or 10 x the fp32 noise floor where larger (see `_dpo.check_against`)
OPTIONS = {"num_iterations": 2, "epsilon": 0.05}


def test_dp2_tp2_level3_matches_trl_on_one_process(pool, tmp_path):
    hf_dir = save_tiny_llama(str(tmp_path / "llama"))
    expected = trl_reference(hf_dir, str(tmp_path / "reference"), **OPTIONS)
    moved = trl_reference(perturbed_copy(hf_dir, tmp_path / "perturbed"), str(tmp_path / "ref2"), **OPTIONS)
    noise = noise_floor(expected, moved)
    layout = {"tensor_parallel_size": 2, "sharding_level": 3, "per_device_train_batch_size": 6}
    results = pool.run(train_parallel, hf_dir, str(tmp_path / "parallel"), **OPTIONS, **layout)
    for rank, result in enumerate(results):
        worst = check_against(result["every"], expected, noise, TOL)
        if rank == 0:
            print("\ndp2 x tp2 level 3 worst relative error:", {k: f"{v:.1e}" for k, v in sorted(worst.items()) if v})
            print("fp32 noise floor:", {k: f"{v:.1e}" for k, v in sorted(noise.items()) if v})
