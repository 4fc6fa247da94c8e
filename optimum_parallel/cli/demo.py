"""The demo: a small Llama trained with tensor parallelism next to the same model on one process.

Rank 0 writes a real HF checkpoint (random init, no hub), every rank loads it, parallelizes it
over the tp group, and trains a few AdamW steps on a built-in synthetic dataset; rank 0 then
trains the unsplit model on the same batches and prints both loss curves side by side.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.utils import logging as hf_logging

from ..frontends.manager import ParallelizersManager
from ..mesh import init_mesh, ranks

DEMO_CONFIG = dict(
    vocab_size=500,  # deliberately not a multiple of tp: uneven vocab shards
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def synthetic_batches(vocab_size: int, steps: int, batch: int, seq: int, seed: int = 0) -> list[dict]:
    """Arithmetic sequences (start, start+d, start+2d, ... mod vocab): learnable, so the loss falls."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        start = torch.randint(0, vocab_size, (batch, 1), generator=gen)
        step = torch.randint(1, 3, (batch, 1), generator=gen)
        input_ids = (start + step * torch.arange(seq)) % vocab_size
        batches.append({"input_ids": input_ids, "labels": input_ids.clone()})
    return batches


NOISE = 1e-7  # relative weight perturbation that measures how far fp32 rounding alone drifts in training


def _perturbed(checkpoint: str, scale: float):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1 + scale * torch.randn(param.shape, generator=gen))
    return model


def _train(model, batches: list[dict], lr: float, optimizer_for=None) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    if optimizer_for is not None:
        optimizer = optimizer_for(optimizer)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _shared_checkpoint_dir(output_dir: str | None) -> str:
    """Rank 0 picks the directory and writes the checkpoint; the others learn the path."""
    path = [None]
    if ranks.global_rank() == 0:
        path[0] = output_dir or tempfile.mkdtemp(prefix="optimum-parallel-demo-")
        Path(path[0]).mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(LlamaConfig(**DEMO_CONFIG)).save_pretrained(path[0])
    dist.broadcast_object_list(path, src=0)
    return path[0]


def run_demo(steps: int = 20, batch: int = 8, seq: int = 64, lr: float = 3e-3, output_dir: str | None = None) -> float:
    """Run the demo on the current torchrun world (tp = world size).

    Returns the max loss difference if it exceeds what fp32 rounding alone explains, else 0.
    """
    started = time.perf_counter()
    hf_logging.disable_progress_bar()
    mesh = init_mesh()
    rank = ranks.global_rank()
    checkpoint = _shared_checkpoint_dir(output_dir)
    batches = synthetic_batches(DEMO_CONFIG["vocab_size"], steps, batch, seq)

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    parallelizer = ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model)
    mapping = model.orig_param_to_parallel_param
    parallel_losses = _train(model, batches, lr, lambda opt: parallelizer.optimizer_for_mp(opt, mapping))

    if rank == 0:
        reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        total_params = sum(p.numel() for p in reference.parameters())
        single_losses = _train(reference, batches, lr)
        noise_losses = _train(_perturbed(checkpoint, NOISE), batches, lr)
        local_params = sum(p.numel() for p in model.parameters())
        print(f"\noptimum-parallel demo: Llama ({total_params / 1e6:.2f}M parameters) from {checkpoint}")
        print(f"tensor parallel size {mesh.tp_size} on {mesh.device_type}; rank 0 holds {local_params / 1e6:.2f}M")
        print(f"fp32 noise floor: the single-process run again with weights x (1 + {NOISE:g} * randn)\n")
        header = ["step", f"loss tp={mesh.tp_size}", "loss 1 proc", "|diff|", "noise floor"]
        print(" | ".join(f"{h:>12}" for h in header))
        print("-+-".join("-" * 12 for _ in header))
        rows = zip(parallel_losses, single_losses, noise_losses, strict=True)
        for step, (tp_loss, single, noisy) in enumerate(rows, start=1):
            print(
                f"{step:>12} | {tp_loss:>12.6f} | {single:>12.6f} | {abs(tp_loss - single):>12.2e} | "
                f"{abs(noisy - single):>12.2e}"
            )
        max_diff = max(abs(a - b) for a, b in zip(parallel_losses, single_losses, strict=True))
        floor = max(abs(a - b) for a, b in zip(noise_losses, single_losses, strict=True))
        print(
            f"\nmax |loss difference| = {max_diff:.2e} (noise floor {floor:.2e}) over {steps} steps "
            f"in {time.perf_counter() - started:.1f} s"
        )
        max_diff = max_diff if max_diff > max(10 * floor, 1e-5) else 0.0
    else:
        max_diff = 0.0
    result = [max_diff]
    dist.broadcast_object_list(result, src=0)
    dist.destroy_process_group()
    return result[0]
