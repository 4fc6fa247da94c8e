"""Shared by the DPO tests: a word-level tokenizer over a tiny model's vocabulary, a preference dataset with prompts,
chosen and rejected completions of different lengths (so rows carry padding), the arguments, and TRL's DPOTrainer on
one process as the reference."""

from __future__ import annotations

import torch

STEPS = 3
METRICS = (
    "loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
    "logps/rejected", "entropy", "mean_token_accuracy", "logits/chosen", "logits/rejected", "num_tokens",
)  # fmt: skip


def make_tokenizer(vocab_size: int):
    """Token `i` is the word `t{i}`; `t2` (the eos TRL appends) splits off the word before it."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t1"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex("t[0-9]+"), "isolated")]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0", eos_token="t2", unk_token="t1")


def preference_dataset(vocab_size: int, rows: int = 16):
    """`rows` prompts of 2-7 tokens, each with a chosen and a rejected completion of 1-6 tokens."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(5)

    def words(low: int, high: int) -> str:
        n = int(torch.randint(low, high, (1,), generator=gen))
        return " ".join(f"t{i}" for i in torch.randint(3, vocab_size, (n,), generator=gen).tolist())

    data = [{"prompt": words(2, 8), "chosen": " " + words(1, 7), "rejected": " " + words(1, 7)} for _ in range(rows)]
    return Dataset.from_list(data)


def dpo_args(output_dir: str, **extra) -> dict:
    return dict(
        output_dir=output_dir, per_device_train_batch_size=4, max_steps=STEPS, learning_rate=0.5, optim="sgd",
        logging_steps=1, seed=0, report_to="none", disable_tqdm=True, use_cpu=True, save_strategy="no",
        ddp_timeout=60, bf16=False, beta=0.1,  # fp32 (TRL's configs may default to bf16)
    ) | extra  # fmt: skip


def save_tiny(path, model_type: str = "llama") -> str:
    from _grpo import TINY
    from _models import build_model, tiny_config

    config = tiny_config(model_type, pad_token_id=0, eos_token_id=2, **TINY.get(model_type, {}))
    build_model(config, seed=3).save_pretrained(path)
    make_tokenizer(config.vocab_size).save_pretrained(path)
    return str(path)


def metrics_per_step(log_history: list[dict]) -> dict[int, dict[str, float]]:
    return {e["step"]: {k: e[k] for k in METRICS if k in e} for e in log_history if "loss" in e}


def trl_reference(hf_dir: str, output_dir: str, evaluate: bool = False, **options) -> dict[int, dict[str, float]]:
    """TRL's DPOTrainer on one process: its metrics per step (`evaluate`: its evaluation's, before training)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    peft_config = options.pop("peft_config", None)
    args = DPOConfig(**dpo_args(output_dir, **options))
    data = preference_dataset(model.config.vocab_size)
    trainer = DPOTrainer(
        model, args=args, train_dataset=data, processing_class=tokenizer, peft_config=peft_config,
        eval_dataset=data if evaluate else None,
    )  # fmt: skip
    if evaluate:
        return evaluation(trainer.evaluate())
    trainer.train()
    return metrics_per_step(trainer.state.log_history)


def evaluation(metrics: dict) -> dict[int, dict[str, float]]:
    """An evaluation's DPO metrics, as a step 1 (for `relative_errors`)."""
    return {1: {k: metrics[f"eval_{k}"] for k in METRICS if f"eval_{k}" in metrics and k != "num_tokens"}}


def train_parallel_dpo(
    hf_dir: str, output_dir: str, options: dict, layout: dict, evaluate: bool = False
) -> dict[int, dict[str, float]]:
    """ParallelDPOTrainer on this rank (a pool task): its metrics per step (`evaluate`: its evaluation's, before
    training)."""
    from transformers import AutoTokenizer

    from optimum_parallel.integrations.trl import ParallelDPOConfig, ParallelDPOTrainer

    options = dict(options)
    peft_config = options.pop("peft_config", None)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    args = ParallelDPOConfig(**dpo_args(output_dir, **options, **layout))
    data = preference_dataset(tokenizer.vocab_size)
    trainer = ParallelDPOTrainer(
        hf_dir, args=args, model_kwargs={"dtype": torch.float32}, processing_class=tokenizer,
        train_dataset=data, peft_config=peft_config, eval_dataset=data if evaluate else None,
    )  # fmt: skip
    if evaluate:
        return evaluation(trainer.evaluate())
    trainer.train()
    return metrics_per_step(trainer.state.log_history)


def perturbed_copy(hf_dir: str, out_dir, scale: float = 1e-7) -> str:
    """The checkpoint at `hf_dir` with every weight perturbed by relative `scale`: TRL's run from it measures the
    fp32 noise floor of each metric."""
    import shutil

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(17)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1 + scale * torch.randn(param.shape, generator=gen))
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src := f"{hf_dir}/{name}") and __import__("os").path.exists(src):
            shutil.copy(src, out_dir)
    return str(out_dir)


def noise_floor(expected: dict, perturbed: dict) -> dict[str, float]:
    """Per metric, the largest |difference| over the steps (those that log it) between TRL's runs from the weights
    and from the perturbed weights."""
    keys = {key for values in expected.values() for key in values}
    return {
        key: max(abs(perturbed[step][key] - values[key]) for step, values in expected.items() if key in values)
        for key in keys
    }


def check_against(got: dict, expected: dict, noise: dict, tol: float, floor: float = 1e-3) -> dict[str, float]:
    """The worst relative error of each metric (see `relative_errors`); asserts each step's error is within `tol`
    relative, or 10 x the metric's fp32 noise floor where that is larger (the rewards are differences of log-probs:
    their noise is that of the log-probs, ~1e-7 of |logps|, on values near 0)."""
    worst = relative_errors(got, expected, floor)
    for step, values in expected.items():
        for key, value in values.items():
            allowed = max(tol * max(abs(value), floor), 10 * noise[key])
            assert abs(got[step][key] - value) <= allowed, (step, key, got[step][key], value, allowed)
    return worst


def relative_errors(got: dict, expected: dict, floor: float = 1e-3) -> dict[str, float]:
    """The worst relative error of each metric over the steps (|expected| below `floor` counts as `floor`: the
    rewards of step 1 are 0, policy and reference being equal)."""
    assert sorted(got) == sorted(expected), (got, expected)
    worst: dict[str, float] = {}
    for step, values in expected.items():
        assert sorted(got[step]) == sorted(values), (step, got[step], values)
        for key, value in values.items():
            err = abs(got[step][key] - value) / max(abs(value), floor)
            worst[key] = max(worst.get(key, 0.0), err)
    return worst
