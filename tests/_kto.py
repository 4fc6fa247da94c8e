"""What the KTO tests share: an unpaired preference dataset over the DPO tests' tiny models and tokenizer (prompts of
2-7 tokens, completions of 1-6, desirable and undesirable rows mixed in every batch, so rows carry padding and the
prompt tokens are -100), TRL's `KTOTrainer` on one process and `ParallelKTOTrainer` on a rank. At dp = N the
reference rotates the KL completions within batches of the replica's size, as TRL on N processes rotates them."""

from __future__ import annotations

import copy

import torch
from _dpo import dpo_args

STEPS = 3
METRICS = (
    "loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
    "logits/chosen", "logits/rejected", "entropy", "num_tokens", "grad_norm",
)  # fmt: skip


def unpaired_dataset(vocab_size: int, rows: int = 24):
    """`rows` (prompt, completion, label) rows, two desirable for one undesirable (both kinds in every batch of 4)."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(7)

    def words(low: int, high: int) -> str:
        n = int(torch.randint(low, high, (1,), generator=gen))
        return " ".join(f"t{i}" for i in torch.randint(3, vocab_size, (n,), generator=gen).tolist())

    data = [{"prompt": words(2, 8), "completion": " " + words(1, 7), "label": i % 3 != 0} for i in range(rows)]
    return Dataset.from_list(data)


def metrics_per_step(log_history: list[dict]) -> dict[int, dict[str, float]]:
    return {e["step"]: {k: e[k] for k in METRICS if k in e} for e in log_history if "loss" in e}


def trl_reference(hf_dir: str, output_dir: str, kl_batch: int | None = None, **options) -> dict[int, dict[str, float]]:
    """TRL's KTOTrainer on one process: its metrics per step (`kl_batch`: the KL completions rotated within batches
    of that size, as on several processes)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    class Trainer(KTOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            if kl_batch is not None:
                args = copy.copy(args)
                args.per_device_train_batch_size = kl_batch
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    args = KTOConfig(**dpo_args(output_dir, **options))
    trainer = Trainer(model, args=args, train_dataset=unpaired_dataset(model.config.vocab_size),
                      processing_class=tokenizer)  # fmt: skip
    trainer.train()
    return metrics_per_step(trainer.state.log_history)


def train_parallel_kto(hf_dir: str, output_dir: str, options: dict, layout: dict) -> dict[int, dict[str, float]]:
    """ParallelKTOTrainer on this rank (a pool task): its metrics per step."""
    from transformers import AutoTokenizer

    from optimum_parallel.integrations.trl import ParallelKTOConfig, ParallelKTOTrainer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    args = ParallelKTOConfig(**dpo_args(output_dir, **options, **layout))
    trainer = ParallelKTOTrainer(hf_dir, args=args, model_kwargs={"dtype": torch.float32}, processing_class=tokenizer,
                                 train_dataset=unpaired_dataset(tokenizer.vocab_size))  # fmt: skip
    trainer.train()
    return metrics_per_step(trainer.state.log_history)
