"""On-policy distillation with TRL's DistillationTrainer on a parallel student and teacher:
`ParallelDistillationTrainer`.

The student samples completions of the prompts (the parallel model's own `generate`) and learns the teacher's
next-token distribution on them (generalized JSD, `--beta`); both models are split over the same mesh (tensor /
sequence / data parallelism), the teacher frozen, and the divergence is summed over the vocabulary slices, so no rank
holds the whole vocabulary's logits. With `--model_name_or_path` and `--teacher_model_name_or_path` it distils those
checkpoints (same vocabulary) on `--data_file` (JSON lines with "prompt"); without, a tiny random 2-layer Llama
learns from a 3-layer one on random prompts, in a minute on two CPU processes:

    torchrun --nproc-per-node 2 examples/distillation.py --output_dir out --tensor_parallel_size 2 --use_cpu \\
        --bf16 False --max_steps 40 --per_device_train_batch_size 8 --learning_rate 1e-2 --logging_steps 5
    torchrun --nproc-per-node 4 examples/distillation.py --output_dir out --tensor_parallel_size 2 --sharding_level 3 \\
        --model_name_or_path STUDENT_DIR --teacher_model_name_or_path TEACHER_DIR --data_file prompts.jsonl --bf16

`--beta 0` (forward KL), `--beta 1` (reverse KL), `--temperature`, `--max_completion_length` ... work as in TRL. At the
end `out/` holds a consolidated student that `AutoModelForCausalLM.from_pretrained("out")` loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from _tiny import tiny_checkpoint  # examples/_tiny.py: the tiny student trained when none is given
from transformers import AutoTokenizer, HfArgumentParser

from optimum_parallel.integrations.trl import ParallelDistillationConfig, ParallelDistillationTrainer


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "The student (default: tiny)."})
    data_file: str | None = field(default=None, metadata={"help": "JSON lines: prompt."})
    prompts: int = field(default=256, metadata={"help": "Random prompts (without --data_file)."})


def tiny_teacher(student_dir: str, path: str) -> str:
    """A random 3-layer Llama with the student's vocabulary and tokenizer, saved once."""
    from transformers import AutoConfig, LlamaForCausalLM

    if not os.path.exists(os.path.join(path, "config.json")):
        config = AutoConfig.from_pretrained(student_dir)
        config.num_hidden_layers = 3
        torch.manual_seed(1)
        LlamaForCausalLM(config).save_pretrained(path)
        AutoTokenizer.from_pretrained(student_dir).save_pretrained(path)
    return path


def random_prompts(count: int, vocab_size: int):
    from datasets import Dataset

    gen = torch.Generator().manual_seed(1)
    words = [torch.randint(3, vocab_size, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen)
             for _ in range(count)]  # fmt: skip
    return Dataset.from_dict({"prompt": [" ".join(f"t{w}" for w in row.tolist()) for row in words]})


def main() -> None:
    script, args = HfArgumentParser((ScriptArguments, ParallelDistillationConfig)).parse_args_into_dataclasses()
    student, teacher = script.model_name_or_path, args.teacher_model_name_or_path
    if student is None:
        with args.main_process_first(desc="tiny models"):
            student = tiny_checkpoint(os.path.join(args.output_dir, "tiny-student"))
            teacher = teacher or tiny_teacher(student, os.path.join(args.output_dir, "tiny-teacher"))
    tokenizer = AutoTokenizer.from_pretrained(student)
    if script.data_file is not None:
        from datasets import load_dataset

        train = load_dataset("json", data_files=script.data_file, split="train")
    else:
        train = random_prompts(script.prompts, tokenizer.vocab_size)
    trainer = ParallelDistillationTrainer(
        student, teacher_model=teacher, args=args, train_dataset=train, processing_class=tokenizer
    )
    trainer.train()
    trainer.save_model()  # consolidated: AutoModelForCausalLM.from_pretrained(args.output_dir)
    if args.should_save:
        logged = [e for e in trainer.state.log_history if "entropy" in e]
        print(f"DISTILLATION: loss {logged[0]['loss']:.4f} -> {logged[-1]['loss']:.4f}")


if __name__ == "__main__":
    main()
