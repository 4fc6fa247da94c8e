"""What the benchmark scripts share: the random Llama they build (its arguments, config and batch; the ~0.5B one
of the load and checkpoint benchmarks), a variant's step times, quiet transformers, and byte counts of tensors and of
the process.

    parser = argparse.ArgumentParser(...)
    add_llama_args(parser, seq=256, layers=4, vocab=8192)
    args = parser.parse_args()
    model = build_llama(args, "sdpa")                 # the same fp32 weights in every process (args.seed)
    batch = random_batch(args.vocab, args.batch, args.seq, args.seed)
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

Batch = dict[str, torch.Tensor]

LLAMA_0_5B = dict(  # ~0.5B parameters: the Llama of bench_load.py and bench_checkpoint.py
    vocab_size=32000,
    hidden_size=1536,
    intermediate_size=4096,
    num_hidden_layers=16,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


@dataclass
class StepResult:
    """The step times (ms) and loss of one benchmark variant, or why it failed."""

    name: str
    times_ms: list[float] = field(default_factory=list)
    loss: float | None = None
    error: str | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.times_ms)


def add_llama_args(
    parser: argparse.ArgumentParser,
    *,
    seq: int,
    layers: int = 4,
    vocab: int = 8192,
    heads_help: str | None = None,
    vocab_help: str | None = None,
    seq_help: str | None = None,
) -> None:
    """--seq, --layers, --hidden, --intermediate, --heads and --vocab of the benchmark's Llama."""
    parser.add_argument("--seq", type=int, default=seq, help=seq_help)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument(
        "--intermediate", type=int, default=None, help="MLP size (default: Llama's 11008/4096 x hidden)"
    )
    parser.add_argument("--heads", type=int, default=8, help=heads_help)
    parser.add_argument("--vocab", type=int, default=vocab, help=vocab_help)


def add_run_args(parser: argparse.ArgumentParser, *, deadline: float, deadline_help: str) -> None:
    """--seed (of the weights and the batches) and --deadline (seconds before the workers are killed)."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=deadline, help=deadline_help)


def llama_config(args: argparse.Namespace, longest: int | None = None) -> LlamaConfig:
    """The Llama of `add_llama_args`'s arguments (kv heads: --kv-heads where a script has it, else --heads),
    with room for `longest` tokens (default --seq), untied head."""
    return LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or args.hidden * 11008 // 4096,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=getattr(args, "kv_heads", None) or args.heads,
        vocab_size=args.vocab,
        max_position_embeddings=max(512, longest or args.seq),
        tie_word_embeddings=False,
    )


def build_llama(args: argparse.Namespace, attn: str, config: LlamaConfig | None = None) -> nn.Module:
    """The same random fp32 model in every process (seeded by --seed); train mode (Llama has no dropout:
    train() and eval() compute the same thing)."""
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config or llama_config(args), attn_implementation=attn)
    return model.float().train()


def random_batch(vocab: int, rows: int, seq: int, seed: int) -> Batch:
    """input_ids of `rows` x `seq` random tokens (generator seeded with seed + 1) and the same ids as labels."""
    generator = torch.Generator().manual_seed(seed + 1)
    input_ids = torch.randint(0, vocab, (rows, seq), generator=generator)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def quiet_transformers() -> None:
    """No warnings or progress bars from transformers in the benchmark output."""
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2 parameters, gradients, optimizer state, transformers' TP); any other
    tensor as is."""
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(tensors: Iterable[object]) -> int:
    """Bytes of this rank's data of the tensors among `tensors` (DTensors by their local shard)."""
    total = 0
    for t in tensors:
        if torch.is_tensor(t):
            t = local_tensor(t)
            total += t.numel() * t.element_size()
    return total


def proc_status_bytes(field: str) -> int:
    """A memory line of /proc/self/status (VmRSS, VmHWM, ...) in bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(f"{field} not in /proc/self/status")
