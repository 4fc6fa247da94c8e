"""A reward model with TRL's RewardTrainer on a parallel model: `ParallelRewardTrainer`.

The model is `AutoModelForSequenceClassification` with one label (a causal checkpoint gets a new value head, drawn
from the seed as TRL draws it), split over the mesh (tensor / sequence / data parallelism); its value head stays whole
on every rank. With `--model_name_or_path` it trains that checkpoint on `--data_file` (JSON lines with "prompt",
"chosen" and "rejected"); without, a tiny random Llama on the DPO example's toy task (the chosen completion repeats the
prompt's first word), in a minute on two CPU processes:

    torchrun --nproc-per-node 2 examples/reward.py --output_dir out --tensor_parallel_size 2 --use_cpu --bf16 False \\
        --max_steps 40 --per_device_train_batch_size 8 --learning_rate 1e-2 --logging_steps 5
    torchrun --nproc-per-node 4 examples/reward.py --output_dir out --tensor_parallel_size 2 --sharding_level 3 \\
        --sequence_parallel --model_name_or_path MODEL_DIR --data_file prefs.jsonl --bf16

`--center_rewards_coefficient 0.01`, `--max_length` ... work as in TRL. At the end `out/` holds a consolidated
checkpoint that `AutoModelForSequenceClassification.from_pretrained("out")` loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from _tiny import tiny_checkpoint  # examples/_tiny.py: the tiny model trained when none is given
from dpo import toy_pairs  # examples/dpo.py: the toy preference task
from transformers import AutoTokenizer, HfArgumentParser

from optimum_parallel.integrations.trl import ParallelRewardConfig, ParallelRewardTrainer


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "A local checkpoint (default: tiny)."})
    data_file: str | None = field(default=None, metadata={"help": "JSON lines: prompt, chosen, rejected."})
    pairs: int = field(default=256, metadata={"help": "Pairs of the toy task (without --data_file)."})


def main() -> None:
    script, args = HfArgumentParser((ScriptArguments, ParallelRewardConfig)).parse_args_into_dataclasses()
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
    trainer = ParallelRewardTrainer(model_dir, args=args, train_dataset=train, processing_class=tokenizer)
    trainer.train()
    trainer.save_model()  # consolidated: AutoModelForSequenceClassification.from_pretrained(args.output_dir)
    if args.should_save:
        logged = [e for e in trainer.state.log_history if "accuracy" in e]
        first, final = logged[0], logged[-1]
        print(
            f"REWARD: loss {first['loss']:.4f} -> {final['loss']:.4f}, accuracy {first['accuracy']:.2f} -> "
            f"{final['accuracy']:.2f}, margin {first['margin']:.4f} -> {final['margin']:.4f}"
        )


if __name__ == "__main__":
    main()
