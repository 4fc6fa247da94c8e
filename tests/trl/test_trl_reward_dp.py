"""TRL's RewardTrainer on a parallel model on 4 ranks: dp=2 x tp=2 at sharding level 3 (FSDP2), each replica half of
TRL's batch; cp=2 x tp=2 with sp (the pooled token on one cp rank, the head gathering the sequence over tp); and
dp=2 x pp=2, each replica's pipeline pass weighing its own rows. Each logs step by step what TRL's RewardTrainer logs
on one process with the whole batch (gloo, 4 ranks)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from _dpo import check_against, noise_floor, perturbed_copy, save_tiny  # noqa: E402
from _reward import reward_checkpoint, train_parallel_reward, trl_reference  # noqa: E402

WORLD_SIZE = 4
TOL = 1e-5  # relative, or 10 x the fp32 noise floor where larger (see `_dpo.check_against`)
LAYOUTS = {
    "dp2-tp2-level3": {"tensor_parallel_size": 2, "sharding_level": 3, "per_device_train_batch_size": 2},
    "cp2-tp2-sp": {"context_parallel_size": 2, "tensor_parallel_size": 2, "sequence_parallel": True},
    "dp2-pp2": {"pipeline_parallel_size": 2, "per_device_train_batch_size": 2},
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[str, dict, dict]:
    """The reward checkpoint, TRL's metrics from it and their fp32 noise floor (from the backbone perturbed by
    relative 1e-7)."""
    causal = save_tiny(tmp_path_factory.mktemp("hf") / "llama")
    moved = perturbed_copy(causal, tmp_path_factory.mktemp("perturbed") / "llama")
    hf_dir, moved = (reward_checkpoint(path, tmp_path_factory.mktemp("reward")) for path in (causal, moved))
    expected = trl_reference(hf_dir, str(tmp_path_factory.mktemp("ref")))
    noise = noise_floor(expected, trl_reference(moved, str(tmp_path_factory.mktemp("ref"))))
    print("noise", {k: f"{v:.1e}" for k, v in noise.items()})
    return hf_dir, expected, noise


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_reward_on_four_ranks_matches_trl_on_one_process(pool, reference, tmp_path, name):
    hf_dir, expected, noise = reference
    assert "grad_norm" in expected[1] and 0 < expected[1]["accuracy"] < 1, expected
    for rank, got in enumerate(pool.run(train_parallel_reward, hf_dir, str(tmp_path), {}, LAYOUTS[name])):
        worst = check_against(got, expected, noise, TOL)
        print(name, rank, {k: f"{v:.1e}" for k, v in worst.items()})
