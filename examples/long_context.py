"""Long-context training with context parallelism: the sequence split over cp ranks, ring attention over all of it.

    torchrun --nproc-per-node 2 examples/long_context.py --cp 2 --seq 8192            # CPU (gloo) or GPUs (NCCL)
    torchrun --nproc-per-node 4 examples/long_context.py --cp 2 --tp 2 --seq 16384    # cp x tp
    torchrun --nproc-per-node 2 examples/long_context.py --cp 2 --model_name_or_path MODEL_DIR

Without a model directory it trains a small random Llama. Every rank of a cp group is given the same whole batch
(dp ranks different ones); each keeps chunks i and 2cp-1-i of the sequence, so per-rank activations shrink by cp
while the loss and gradients stay those of one device.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

import optimum_parallel as op


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_name_or_path", default=None)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--strategy", default="ring", help="ring or all_to_all")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)

    mesh = op.init_mesh(cp=args.cp, tp=args.tp)  # dp = world / (cp * tp)
    torch.manual_seed(0)
    if args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32)
    else:
        config = LlamaConfig(
            vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=args.seq,
        )  # fmt: skip
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model, context_parallel_strategy=args.strategy)
    optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
    # gradients averaged over dp x cp: each cp rank's gradient covers its own tokens
    model, optimizer = op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": 0}})

    generator = torch.Generator().manual_seed(mesh.rank("dp"))  # one data stream per dp replica
    losses = []
    for step in range(args.steps):
        input_ids = torch.randint(0, model.config.vocab_size, (1, args.seq), generator=generator)
        loss = model(input_ids=input_ids, labels=input_ids).loss  # the whole sequence's mean loss
        loss.backward()
        op.clip_grad_norm_(model, max_norm=1.0)  # the global norm: torch's would see one rank's shards
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f} ({args.seq} tokens, cp={args.cp}, tp={args.tp})")
    return losses


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
