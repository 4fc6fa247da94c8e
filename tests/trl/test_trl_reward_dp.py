"""TRL's RewardTrainer on a parallel model with data parallelism: dp=2 x tp=2 at sharding level 3 (FSDP2), each
replica half of TRL's batch, logs step by step what TRL's RewardTrainer logs on one process with the whole batch
(gloo, 4 ranks)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from _dpo import check_against, noise_floor, perturbed_copy, save_tiny  # noqa: E402
from _reward import reward_checkpoint, train_parallel_reward, trl_reference  # noqa: E402

WORLD_SIZE = 4
TOL = 1e-5  # relative, or 10 x the fp32 noise floor where larger (see `_dpo.check_against`)
DP_TP_L3 = {"tensor_parallel_size": 2, "sharding_level": 3, "per_device_train_batch_size": 2}


def test_reward_with_data_parallelism_matches_trl_on_one_process(pool, tmp_path_factory):
    causal = save_tiny(tmp_path_factory.mktemp("hf") / "llama")
    moved = perturbed_copy(causal, tmp_path_factory.mktemp("perturbed") / "llama")
    hf_dir, moved = (reward_checkpoint(path, tmp_path_factory.mktemp("reward")) for path in (causal, moved))
    expected = trl_reference(hf_dir, str(tmp_path_factory.mktemp("ref")))
    noise = noise_floor(expected, trl_reference(moved, str(tmp_path_factory.mktemp("ref"))))
    print("noise", {k: f"{v:.1e}" for k, v in noise.items()})
    results = pool.run(train_parallel_reward, hf_dir, str(tmp_path_factory.mktemp("out")), {}, DP_TP_L3)
    for rank, got in enumerate(results):
        worst = check_against(got, expected, noise, TOL)
        print("dp2-tp2-level3", rank, {k: f"{v:.1e}" for k, v in worst.items()})
