"""Supervised fine-tuning with TRL's SFTTrainer on a parallel model: `ParallelSFTTrainer`, packed sequences.

The model is split over the mesh (tensor / sequence / pipeline / context / data parallelism); packed rows keep each
document to itself on every layout, and TRL's `entropy`, `mean_token_accuracy` and `num_tokens` are logged from the
vocab-parallel logits. With `--model_name_or_path` it trains that checkpoint on `--data_file` (JSON lines with
"text" or "messages"); without, a tiny random Llama built from its config on a toy language (each document counts up
from a random word), in a minute on two CPU processes:

    torchrun --nproc-per-node 2 examples/sft.py --output_dir out --tensor_parallel_size 2 --use_cpu --bf16 False \\
        --packing --max_length 64 --max_steps 40 --per_device_train_batch_size 4 --learning_rate 5e-3
    torchrun --nproc-per-node 4 examples/sft.py --output_dir out --tensor_parallel_size 2 --context_parallel_size 2 \\
        --model_name_or_path MODEL_DIR --data_file data.jsonl --max_length 16384 --bf16

`--packing False --padding_free True`, `--pipeline_parallel_size 2` ... work as in TRL. At the end `out/` holds a
consolidated checkpoint that `AutoModelForCausalLM.from_pretrained("out")` loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from _tiny import tiny_checkpoint  # examples/_tiny.py: the tiny model trained when none is given
from transformers import AutoTokenizer, HfArgumentParser

from optimum_parallel.integrations.trl import ParallelSFTConfig, ParallelSFTTrainer


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "A local checkpoint (default: tiny)."})
    data_file: str | None = field(default=None, metadata={"help": "JSON lines: text or messages."})
    documents: int = field(default=256, metadata={"help": "Documents of the toy language (without --data_file)."})


def toy_documents(count: int, vocab_size: int):
    """Documents of 3-12 words counting up from a random word (wrapping around the vocabulary's words)."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(1)
    words = vocab_size - 3
    rows = []
    for _ in range(count):
        start, length = (
            int(torch.randint(0, words, (1,), generator=gen)),
            int(torch.randint(3, 13, (1,), generator=gen)),
        )
        rows.append({"text": " ".join(f"t{3 + (start + i) % words}" for i in range(length))})
    return Dataset.from_list(rows)


def main() -> None:
    script, args = HfArgumentParser((ScriptArguments, ParallelSFTConfig)).parse_args_into_dataclasses()
    model_dir = script.model_name_or_path
    if model_dir is None:
        with args.main_process_first(desc="tiny model"):
            model_dir = tiny_checkpoint(os.path.join(args.output_dir, "tiny-model"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if script.data_file is not None:
        from datasets import load_dataset

        train = load_dataset("json", data_files=script.data_file, split="train")
    else:
        train = toy_documents(script.documents, tokenizer.vocab_size)
    trainer = ParallelSFTTrainer(model_dir, args, train_dataset=train, processing_class=tokenizer)
    trainer.train()
    trainer.save_model()  # consolidated: AutoModelForCausalLM.from_pretrained(args.output_dir)
    if args.should_save:
        logged = [e for e in trainer.state.log_history if "mean_token_accuracy" in e]
        first, final = logged[0], logged[-1]
        print(
            f"SFT: loss {first['loss']:.4f} -> {final['loss']:.4f}, mean_token_accuracy "
            f"{first['mean_token_accuracy']:.3f} -> {final['mean_token_accuracy']:.3f}, entropy "
            f"{first['entropy']:.3f} -> {final['entropy']:.3f}, num_tokens {final['num_tokens']:.0f}"
        )


if __name__ == "__main__":
    main()
