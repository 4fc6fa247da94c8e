"""Preference optimisation (DPO) with TRL's DPOTrainer on a parallel model: `ParallelDPOTrainer`.

The policy and the reference are both split over the mesh (tensor / sequence / context / data parallelism); the
per-token log-probabilities come from the vocab-parallel log-softmax, so no rank ever holds the whole vocabulary's
logits. With `--model_name_or_path` it trains that checkpoint on `--data_file` (JSON lines with "prompt", "chosen"
and "rejected"); without, a tiny random Llama built from its config on a toy task (the chosen completion repeats the
prompt's first word, the rejected one is a random word), in a minute on two CPU processes:

    torchrun --nproc-per-node 2 examples/dpo.py --output_dir out --tensor_parallel_size 2 --use_cpu --bf16 False \\
        --max_steps 40 --per_device_train_batch_size 8 --learning_rate 1e-2 --logging_steps 5
    torchrun --nproc-per-node 4 examples/dpo.py --output_dir out --tensor_parallel_size 2 --sharding_level 3 \\
        --model_name_or_path MODEL_DIR --data_file prefs.jsonl --bf16

`--loss_type ipo` (or any of TRL's loss types), `--precompute_ref_log_probs`, `--beta` ... work as in TRL. At the
end `out/` holds a consolidated checkpoint that `AutoModelForCausalLM.from_pretrained("out")` loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from _tiny import tiny_checkpoint  # examples/_tiny.py: the tiny model trained when none is given
from transformers import AutoTokenizer, HfArgumentParser

from optimum_parallel.integrations.trl import ParallelDPOConfig, ParallelDPOTrainer


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "A local checkpoint (default: tiny)."})
    data_file: str | None = field(default=None, metadata={"help": "JSON lines: prompt, chosen, rejected."})
    pairs: int = field(default=256, metadata={"help": "Pairs of the toy task (without --data_file)."})


def toy_pairs(count: int, vocab_size: int):
    """Prompts of 3 words; chosen: the first word again, rejected: another word."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(count):
        words = torch.randint(3, vocab_size, (4,), generator=gen).tolist()
        prompt = " ".join(f"t{w}" for w in words[:3])
        rows.append({"prompt": prompt, "chosen": f" t{words[0]}", "rejected": f" t{words[3]}"})
    return Dataset.from_list(rows)


def main() -> None:
    script, args = HfArgumentParser((ScriptArguments, ParallelDPOConfig)).parse_args_into_dataclasses()
    model_dir = script.model_name_or_path
    if model_dir is None:
        with args.main_process_first(desc="tiny model"):
            model_dir = tiny_checkpoint(os.path.join(args.output_dir, "tiny-model"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if script.data_file is not None:
        from datasets import load_dataset

        train = load_dataset("json", data_files=script.data_file, split="train")
    else:
        train = toy_pairs(script.pairs, tokenizer.vocab_size)
    trainer = ParallelDPOTrainer(model_dir, args=args, train_dataset=train, processing_class=tokenizer)
    trainer.train()
    trainer.save_model()  # consolidated: AutoModelForCausalLM.from_pretrained(args.output_dir)
    if args.should_save:
        last = [e for e in trainer.state.log_history if "rewards/accuracies" in e]
        first, final = last[0], last[-1]
        print(
            f"DPO: loss {first['loss']:.4f} -> {final['loss']:.4f}, rewards/accuracies "
            f"{first['rewards/accuracies']:.2f} -> {final['rewards/accuracies']:.2f}, rewards/margins "
            f"{first['rewards/margins']:.4f} -> {final['rewards/margins']:.4f}"
        )


if __name__ == "__main__":
    main()
