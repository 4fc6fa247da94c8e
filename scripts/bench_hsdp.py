"""Benchmark hybrid sharding (dp_config shard_size) against sharding over all dp ranks, on CPU/gloo.

dp=4 (4 processes), sharding_level 3 (FSDP2, parameters resharded after forward), AdamW, a random fp32 Llama
(hidden 256, 4 layers by default): per rank, the bytes of this rank's parameters, gradients and AdamW state
(local tensors: DTensors by their shard, counted after a step), and the median step time (forward, backward,
optimizer step, measured on every rank, the slowest rank per step), for shard_size -1 (all 4 ranks) and 2
(two groups of 2: shard in a group, replicate across), with ratios to shard_size -1.

How to run
    OMP_NUM_THREADS=1 python scripts/bench_hsdp.py [--steps 10] [--hidden 256] [--layers 4] [--seq 128]

On a 2-core machine the 4 processes share 2 cores: step times are comparable with each other in one run only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _common import (  # noqa: E402
    add_llama_args,
    add_run_args,
    build_llama,
    print_table,
    quiet_transformers,
    random_batch,
    tensor_bytes,
    timed_steps,
)
from _ranks import run_on_ranks  # noqa: E402

WORLD = 4
SHARD_SIZES = (-1, 2)


def rank_main(rank: int, world: int, shard_size: int, args: argparse.Namespace) -> dict:
    import optimum_parallel as op

    quiet_transformers()
    mesh = op.init_mesh(dp=world)
    model = build_llama(args, "sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    config = {"dp_config": {"sharding_level": 3, "shard_size": shard_size}}
    model, optimizer = op.parallelize(model, optimizer, mesh, config)
    batch = random_batch(args.vocab, args.batch * world, args.seq, args.seed)
    local = {k: v[rank * args.batch : (rank + 1) * args.batch] for k, v in batch.items()}
    grads = []

    def step() -> None:
        model(**local).loss.backward()
        grads.append(tensor_bytes(p.grad for p in model.parameters()))
        optimizer.step()
        optimizer.zero_grad()

    times = timed_steps(step, timed=args.steps, warmup=args.warmup, before=dist.barrier, across_ranks=True)
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    sizes = torch.tensor([tensor_bytes(model.parameters()), grads[-1], tensor_bytes(state)], dtype=torch.float64)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX)  # the rank with the most
    return {
        "params": sizes[0].item(),
        "grads": sizes[1].item(),
        "state": sizes[2].item(),
        "step": times.median,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_llama_args(parser, seq=128, layers=4, vocab=8192)
    add_run_args(parser, deadline=600, deadline_help="seconds before the workers are killed")
    parser.set_defaults(hidden=256, heads=4)
    parser.add_argument("--batch", type=int, default=2, help="rows per dp replica")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    rows = {
        size: run_on_ranks(WORLD, rank_main, (size, args), args.deadline, f"shard_size {size}") for size in SHARD_SIZES
    }
    base = rows[-1]
    mib = 1024**2
    print(
        f"dp={WORLD}, sharding_level 3, AdamW, Llama hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}, "
        f"seq {args.seq}, {args.batch} rows per rank; per rank (the most of any rank), median of {args.steps} steps"
    )
    header = ("shard_size", "params MiB", "grads MiB", "AdamW MiB", "total MiB", "x total", "step ms", "x step")
    table = []
    base_total = base["params"] + base["grads"] + base["state"]
    for size, row in rows.items():
        total = row["params"] + row["grads"] + row["state"]
        table.append(
            (
                f"{size} ({WORLD})" if size == -1 else str(size),
                *(f"{row[key] / mib:.2f}" for key in ("params", "grads", "state")),
                f"{total / mib:.2f}",
                f"{total / base_total:.2f}",
                f"{row['step'] * 1e3:.1f}",
                f"{row['step'] / base['step']:.2f}",
            )
        )
    print_table(header, table, align_numbers=True)


if __name__ == "__main__":
    main()
