"""TRL's RewardTrainer on a parallel model: ParallelRewardTrainer at tp=2 and tp=2 + sp logs, step by step, the loss,
grad_norm, min / mean / max reward, accuracy, margin and num_tokens TRL's RewardTrainer logs on one process (prompts,
chosen and rejected completions of uneven lengths, right-padded rows: the value head pools each row's last real token),
with and without `center_rewards_coefficient`, and so does its evaluation (gloo, 2 ranks). cp and pp:
test_trl_reward_cp_pp.py; 4 ranks (dp x tp at sharding level 3, cp x tp with sp, dp x pp): test_trl_reward_dp.py."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from _dpo import check_against, perturbed_copy, save_tiny  # noqa: E402
from _reward import (  # noqa: E402
    cached_references,
    reward_checkpoint,
    train_parallel_reward,
    trl_reference,
)

WORLD_SIZE = 2
TOL = 1e-5  # relative, per step and metric, or 10 x the fp32 noise floor where larger (see `_dpo.check_against`)

TP2 = {"tensor_parallel_size": 2}
SP = {"tensor_parallel_size": 2, "sequence_parallel": True}
CASES = {
    "tp2": ({}, TP2),
    "sp": ({}, SP),
    "tp2-centred": ({"center_rewards_coefficient": 0.01}, TP2),
}


@pytest.fixture(scope="module")
def causal_dir(tmp_path_factory) -> str:
    return save_tiny(tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture(scope="module")
def reward_dirs(causal_dir, tmp_path_factory) -> tuple[str, str]:
    """The reward checkpoint and the same with its backbone perturbed by relative 1e-7 (for the noise floor)."""
    moved = perturbed_copy(causal_dir, tmp_path_factory.mktemp("perturbed") / "llama")
    return tuple(reward_checkpoint(path, tmp_path_factory.mktemp("reward")) for path in (causal_dir, moved))


@pytest.fixture(scope="module")
def reference(reward_dirs, tmp_path_factory):
    return cached_references(reward_dirs, tmp_path_factory)


@pytest.mark.parametrize("case", list(CASES))
def test_reward_matches_trl_on_one_process(pool, reward_dirs, reference, tmp_path, case):
    options, layout = CASES[case]
    expected, noise = reference(**options)
    assert len(expected) == 3 and 0 < expected[1]["accuracy"] < 1, expected  # a real comparison, not a constant
    for rank, got in enumerate(pool.run(train_parallel_reward, reward_dirs[0], str(tmp_path), options, layout)):
        worst = check_against(got, expected, noise, TOL)
        print(case, rank, {k: f"{v:.1e}" for k, v in worst.items()})


def test_evaluation_matches_trl_on_one_process(pool, reward_dirs, tmp_path, tmp_path_factory):
    expected = trl_reference(reward_dirs[0], str(tmp_path_factory.mktemp("ref")), evaluate=True)
    assert "loss" in expected[1] and "margin" in expected[1], expected
    noise = dict.fromkeys(expected[1], 0.0)
    for rank, got in enumerate(pool.run(train_parallel_reward, reward_dirs[0], str(tmp_path), {}, SP, True)):
        worst = check_against(got, expected, noise, TOL)
        print("evaluate", rank, {k: f"{v:.1e}" for k, v in worst.items()})


def test_a_causal_checkpoint_gets_the_head_trl_draws(pool, causal_dir, tmp_path, tmp_path_factory):
    """From a causal LM's checkpoint the one-label head is new: drawn from the seed on every rank, as TRL draws it
    (its loss and rewards from step 1 on show the same head)."""
    expected = trl_reference(causal_dir, str(tmp_path_factory.mktemp("ref")))
    noise = dict.fromkeys(expected[1], 0.0)
    for rank, got in enumerate(pool.run(train_parallel_reward, causal_dir, str(tmp_path), {}, TP2)):
        worst = check_against(got, expected, noise, TOL)
        print("from-causal", rank, {k: f"{v:.1e}" for k, v in worst.items()})
