"""RLOO (REINFORCE leave-one-out) with a verifiable reward on a parallel model: `ParallelRLOOTrainer`.

The toy task of `examples/grpo.py` (a tiny Llama learns to answer "a + b =" with the sum; its tokenizer, dataset,
reward and checkpoint are imported from there): the completions are sampled by the tensor-parallel model itself, the
advantage of each is its reward minus the mean of its group's other rewards, and the policy is trained with TRL's
clipped per-sequence loss on vocab-parallel log-probs. Nothing is downloaded:

    torchrun --nproc-per-node 2 examples/rloo.py --output-dir out            # tp=2, 30 steps (~1 min on 2 CPU cores)
    torchrun --nproc-per-node 4 examples/rloo.py --output-dir out --tp 2     # dp=2 x tp=2
    python examples/rloo.py --output-dir out --one-process                   # TRL's RLOOTrainer, for comparison

It prints the mean reward of every step (`step N: mean reward R`).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from grpo import PrintReward, grpo_options, sum_reward, tiny_model, toy_dataset, toy_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tp", type=int, default=None, help="tensor_parallel_size (default: every process)")
    parser.add_argument("--one-process", action="store_true", help="TRL's RLOOTrainer on one process instead")
    cli = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    out = Path(cli.output_dir)
    model_dir, ready = out / "model", out / "model" / ".ready"
    if int(os.environ.get("RANK", "0")) == 0 and not ready.exists():
        tiny_model(model_dir)
        ready.touch()
    while not ready.exists():  # the other ranks read the checkpoint once it is whole
        time.sleep(0.1)
    options = grpo_options(str(out / "run"), cli.steps)  # RLOOConfig takes the same settings
    common = dict(reward_funcs=sum_reward, train_dataset=toy_dataset(), processing_class=toy_tokenizer(),
                  callbacks=[PrintReward()])  # fmt: skip
    if cli.one_process:
        from trl import RLOOConfig, RLOOTrainer

        trainer = RLOOTrainer(str(model_dir), args=RLOOConfig(**options), **common)
    else:
        from optimum_parallel import ParallelRLOOConfig, ParallelRLOOTrainer

        args = ParallelRLOOConfig(**options, tensor_parallel_size=cli.tp or world)
        trainer = ParallelRLOOTrainer(str(model_dir), args=args, model_kwargs={"dtype": torch.float32}, **common)
    trainer.train()


if __name__ == "__main__":
    main()
