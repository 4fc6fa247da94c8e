"""ParallelKTOTrainer at dp=2 x tp=2, sharding level 3 (FSDP2) (gloo, 4 ranks), each replica half of TRL's batch of 4,
logs step by step what TRL's KTOTrainer logs on one process with the whole batch and the KL completions rotated within
each half, as TRL on 2 processes rotates them within each process's batch: within 1e-5 relative or 10 x the fp32 noise
floor."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from _dpo import check_against, noise_floor, perturbed_copy, save_tiny  # noqa: E402
from _kto import train_parallel_kto, trl_reference  # noqa: E402

WORLD_SIZE = 4
TOL = 1e-5
OPTIONS = {"optim": "adamw_torch", "learning_rate": 1e-2}
DP_TP_L3 = {"tensor_parallel_size": 2, "sharding_level": 3, "per_device_train_batch_size": 2}


def test_dp2_tp2_level3_matches_trl_on_one_process(pool, tmp_path):
    hf_dir = save_tiny(tmp_path / "llama")
    expected = trl_reference(hf_dir, str(tmp_path / "ref"), kl_batch=2, **OPTIONS)
    moved = trl_reference(perturbed_copy(hf_dir, tmp_path / "perturbed"), str(tmp_path / "ref2"), kl_batch=2, **OPTIONS)
    noise = noise_floor(expected, moved)
    assert expected[3]["kl"] > 0, expected[3]
    for rank, got in enumerate(pool.run(train_parallel_kto, hf_dir, str(tmp_path / "parallel"), OPTIONS, DP_TP_L3)):
        worst = check_against(got, expected, noise, TOL)
        if rank == 0:
            print("\ndp2 x tp2 level 3 worst relative error:", {k: f"{v:.1e}" for k, v in sorted(worst.items()) if v})
            print("fp32 noise floor:", {k: f"{v:.1e}" for k, v in sorted(noise.items()) if v})
