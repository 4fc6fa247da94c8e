"""Shared by the reward-model tests: a tiny one-label sequence-classification checkpoint (a causal Llama's backbone
and a seeded `score` head), TRL's RewardTrainer on one process as the reference and ParallelRewardTrainer on a rank
(the preference dataset, tokenizer, noise floor and comparison are the DPO tests', `_dpo.py`)."""

from __future__ import annotations

import torch
from _dpo import dpo_args, noise_floor, preference_dataset

METRICS = ("loss", "grad_norm", "min_reward", "mean_reward", "max_reward", "accuracy", "margin", "num_tokens")


def reward_checkpoint(causal_dir: str, out_dir) -> str:
    """`causal_dir`'s backbone under a one-label head drawn from a fixed seed (the same head for a perturbed copy of
    the backbone), saved with its tokenizer."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(7)
    model = AutoModelForSequenceClassification.from_pretrained(causal_dir, num_labels=1, dtype=torch.float32)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(causal_dir).save_pretrained(out_dir)
    return str(out_dir)


def reward_args(output_dir: str, **extra) -> dict:
    """The DPO tests' arguments (batch of 4 pairs, sgd, 3 steps, fp32) without DPO's `beta`, a larger step."""
    args = dpo_args(output_dir, learning_rate=1.0, **extra)
    args.pop("beta")
    return args


def metrics_per_step(log_history: list[dict]) -> dict[int, dict[str, float]]:
    return {e["step"]: {k: e[k] for k in METRICS if k in e} for e in log_history if "loss" in e}


def evaluation(metrics: dict) -> dict[int, dict[str, float]]:
    """An evaluation's metrics as a step 1 (for `_dpo.check_against`); TRL counts no tokens there."""
    return {1: {k: metrics[f"eval_{k}"] for k in METRICS if f"eval_{k}" in metrics and k != "num_tokens"}}


def trl_reference(hf_dir: str, output_dir: str, evaluate: bool = False, **options) -> dict[int, dict[str, float]]:
    """TRL's RewardTrainer on one process from the path: its metrics per step (`evaluate`: its evaluation's)."""
    from transformers import AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    data = preference_dataset(tokenizer.vocab_size)
    trainer = RewardTrainer(
        hf_dir, args=RewardConfig(**reward_args(output_dir, **options)), train_dataset=data,
        processing_class=tokenizer, eval_dataset=data if evaluate else None,
    )  # fmt: skip
    if evaluate:
        return evaluation(trainer.evaluate())
    trainer.train()
    return metrics_per_step(trainer.state.log_history)


def train_parallel_reward(
    hf_dir: str, output_dir: str, options: dict, layout: dict, evaluate: bool = False
) -> dict[int, dict[str, float]]:
    """ParallelRewardTrainer on this rank (a pool task), from the path: its metrics per step."""
    from transformers import AutoTokenizer

    from optimum_parallel.integrations.trl import ParallelRewardConfig, ParallelRewardTrainer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    data = preference_dataset(tokenizer.vocab_size)
    args = ParallelRewardConfig(**reward_args(output_dir, **options, **layout))
    trainer = ParallelRewardTrainer(
        hf_dir, args=args, train_dataset=data, processing_class=tokenizer, eval_dataset=data if evaluate else None
    )
    if evaluate:
        return evaluation(trainer.evaluate())
    trainer.train()
    return metrics_per_step(trainer.state.log_history)


def cached_references(reward_dirs: tuple[str, str], tmp_path_factory):
    """`run(**options)`: TRL's figures on one process and their fp32 noise floor (the run from the perturbed
    checkpoint), made once per options for a test module."""
    done: dict[str, tuple] = {}

    def run(**options) -> tuple[dict, dict]:
        key = repr(sorted(options.items()))
        if key not in done:
            expected = trl_reference(reward_dirs[0], str(tmp_path_factory.mktemp("ref")), **options)
            moved = trl_reference(reward_dirs[1], str(tmp_path_factory.mktemp("ref")), **options)
            done[key] = expected, noise_floor(expected, moved)
            print("noise", options, {k: f"{v:.1e}" for k, v in done[key][1].items()})
        return done[key]

    return run
