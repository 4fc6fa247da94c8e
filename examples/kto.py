"""Kahneman-Tversky optimisation (KTO) with TRL's KTOTrainer on a parallel model: `ParallelKTOTrainer`.

KTO learns from unpaired feedback: each row is a prompt, one completion and a label (desirable or not). The policy and
the reference are both split over the mesh (tensor / sequence / context / pipeline / data parallelism); the per-token
log-probabilities come from the vocab-parallel log-softmax. With `--model_name_or_path` it trains that checkpoint on
`--data_file` (JSON lines with "prompt", "completion" and "label", or "prompt", "chosen" and "rejected"); without, the
tiny random Llama of the DPO example on a toy task (a desirable completion repeats the prompt's first word, an
undesirable one is a random word), in a minute on two CPU processes:

    torchrun --nproc-per-node 2 examples/kto.py --output_dir out --tensor_parallel_size 2 --use_cpu --bf16 False \\
        --max_steps 40 --per_device_train_batch_size 8 --learning_rate 1e-2 --logging_steps 5
    torchrun --nproc-per-node 4 examples/kto.py --output_dir out --tensor_parallel_size 2 --sharding_level 3 \\
        --model_name_or_path MODEL_DIR --data_file feedback.jsonl --bf16

`--loss_type apo_zero_unpaired`, `--precompute_ref_log_probs`, `--desirable_weight` ... work as in TRL. At the end
`out/` holds a consolidated checkpoint that `AutoModelForCausalLM.from_pretrained("out")` loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from _tiny import tiny_checkpoint  # examples/_tiny.py: the tiny model trained when none is given
from transformers import AutoTokenizer, HfArgumentParser

from optimum_parallel.integrations.trl import ParallelKTOConfig, ParallelKTOTrainer


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "A local checkpoint (default: tiny)."})
    data_file: str | None = field(default=None, metadata={"help": "JSON lines: prompt, completion, label."})
    rows: int = field(default=512, metadata={"help": "Rows of the toy task (without --data_file)."})


def toy_feedback(count: int, vocab_size: int):
    """Prompts of 3 words; every other row desirable (the first word again), the others not (another word)."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(1)
    rows = []
    for i in range(count):
        words = torch.randint(3, vocab_size, (4,), generator=gen).tolist()
        good = i % 2 == 0
        completion = f" t{words[0] if good else words[3]}"
        rows.append({"prompt": " ".join(f"t{w}" for w in words[:3]), "completion": completion, "label": good})
    return Dataset.from_list(rows)


def main() -> None:
    script, args = HfArgumentParser((ScriptArguments, ParallelKTOConfig)).parse_args_into_dataclasses()
    model_dir = script.model_name_or_path
    if model_dir is None:
        with args.main_process_first(desc="tiny model"):
            model_dir = tiny_checkpoint(os.path.join(args.output_dir, "tiny-model"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if script.data_file is not None:
        from datasets import load_dataset

        train = load_dataset("json", data_files=script.data_file, split="train")
    else:
        train = toy_feedback(script.rows, tokenizer.vocab_size)
    trainer = ParallelKTOTrainer(model_dir, args=args, train_dataset=train, processing_class=tokenizer)
    trainer.train()
    trainer.save_model()  # consolidated: AutoModelForCausalLM.from_pretrained(args.output_dir)
    if args.should_save:
        logged = [e for e in trainer.state.log_history if "rewards/chosen" in e]
        first, final = logged[0], logged[-1]
        print(
            f"KTO: loss {first['loss']:.4f} -> {final['loss']:.4f}, rewards/chosen {first['rewards/chosen']:.4f} -> "
            f"{final['rewards/chosen']:.4f}, kl {first['kl']:.4f} -> {final['kl']:.4f}"
        )


if __name__ == "__main__":
    main()
