"""GRPO with a verifiable reward on a parallel model: a tiny Llama learns to answer "a + b =" with the sum.

The completions are sampled by the tensor-parallel model itself, each scored once by `sum_reward` (on the first rank
of its replica), and the policy trained with TRL's clipped GRPO loss on vocab-parallel log-probs. Everything is built
here (a word-level tokenizer over digits and a few symbols, a random-init Llama), nothing is downloaded:

    torchrun --nproc-per-node 2 examples/grpo.py --output-dir out            # tp=2, 30 steps (~1 min on 2 CPU cores)
    torchrun --nproc-per-node 4 examples/grpo.py --output-dir out --tp 2     # dp=2 x tp=2
    python examples/grpo.py --output-dir out --one-process                   # TRL's GRPOTrainer, for comparison

It prints the mean reward of every step (`step N: mean reward R`); `scripts/grpo_reward_curve.py` runs it both ways
and prints the two curves side by side.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

WORDS = ["<pad>", "<unk>", "<eos>", *"0123456789", "+", "=", "?"]  # 16 tokens: splits evenly over tp=2 or 4
TOP = 4  # the operands are 0..TOP, so the sum is one digit


def toy_tokenizer():
    """A word-level tokenizer over `WORDS`; the words of a text are separated by spaces."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def toy_dataset(count: int = 256, seed: int = 0):
    """Prompts "a + b =" with their `answer` (passed to the reward function by TRL as a column)."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    pairs = torch.randint(0, TOP + 1, (count, 2), generator=gen).tolist()
    return Dataset.from_dict({"prompt": [f"{a} + {b} =" for a, b in pairs], "answer": [str(a + b) for a, b in pairs]})


def sum_reward(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """How close the completion's first word is to the sum: 1 - |d - sum| / 9 for a digit d (1 for the sum itself),
    0 for anything else; a partial credit the policy can climb before it knows the sums."""
    rewards = []
    for text, want in zip(completions, answer, strict=True):
        words = text.split()
        digit = words[0] if words and words[0].isdigit() else None
        rewards.append(0.0 if digit is None else 1.0 - abs(int(digit) - int(want)) / 9)
    return rewards


def tiny_model(path: Path) -> str:
    """A random-init Llama (hidden 64, 2 layers) and the tokenizer, saved as a Hugging Face checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(WORDS), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0, eos_token_id=2, bos_token_id=None,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    toy_tokenizer().save_pretrained(path)
    return str(path)


def grpo_options(output_dir: str, steps: int) -> dict:
    """The GRPO settings of both runs: 16 completions a step (2 prompts x 8 generations), up to 4 tokens each."""
    return dict(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=32, num_generations=8,
        max_completion_length=3, learning_rate=1e-2, beta=0.0, logging_steps=1, seed=0, report_to="none",
        disable_tqdm=True, save_strategy="no", bf16=False, gradient_checkpointing=False,
    )  # fmt: skip


class PrintReward(TrainerCallback):
    """Prints each step's mean reward on the first rank."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "reward" in logs:
            print(f"step {state.global_step}: mean reward {logs['reward']:.4f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tp", type=int, default=None, help="tensor_parallel_size (default: every process)")
    parser.add_argument("--one-process", action="store_true", help="TRL's GRPOTrainer on one process instead")
    cli = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    out = Path(cli.output_dir)
    model_dir, ready = out / "model", out / "model" / ".ready"
    if int(os.environ.get("RANK", "0")) == 0 and not ready.exists():
        tiny_model(model_dir)
        ready.touch()
    while not ready.exists():  # the other ranks read the checkpoint once it is whole
        time.sleep(0.1)
    options = grpo_options(str(out / "run"), cli.steps)
    common = dict(reward_funcs=sum_reward, train_dataset=toy_dataset(), processing_class=toy_tokenizer(),
                  callbacks=[PrintReward()])  # fmt: skip
    if cli.one_process:
        from trl import GRPOConfig, GRPOTrainer

        trainer = GRPOTrainer(str(model_dir), args=GRPOConfig(**options), **common)
    else:
        from optimum_parallel import ParallelGRPOConfig, ParallelGRPOTrainer

        args = ParallelGRPOConfig(**options, tensor_parallel_size=cli.tp or world)
        trainer = ParallelGRPOTrainer(str(model_dir), args=args, model_kwargs={"dtype": torch.float32}, **common)
    trainer.train()


if __name__ == "__main__":
    main()
