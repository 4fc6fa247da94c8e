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
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _common import add_llama_args, add_run_args, build_llama, quiet_transformers, random_batch, tensor_bytes  # noqa: E402
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
    times, grads = [], 0
    for step in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        model(**local).loss.backward()
        grads = tensor_bytes(p.grad for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step >= args.warmup:
            times.append(elapsed.item())
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    sizes = torch.tensor([tensor_bytes(model.parameters()), grads, tensor_bytes(state)], dtype=torch.float64)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX)  # the rank with the most
    return {
        "params": sizes[0].item(),
        "grads": sizes[1].item(),
        "state": sizes[2].item(),
        "step": statistics.median(times),
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
    header = f"{'shard_size':>10} | {'params MiB':>10} | {'grads MiB':>9} | {'AdamW MiB':>9} | {'total MiB':>9} | "
    header += f"{'x total':>7} | {'step ms':>7} | {'x step':>6}"
    print(header)
    print("-" * len(header))
    for size, row in rows.items():
        total = row["params"] + row["grads"] + row["state"]
        base_total = base["params"] + base["grads"] + base["state"]
        label = f"{size} ({WORLD})" if size == -1 else str(size)
        print(
            f"{label:>10} | {row['params'] / mib:>10.2f} | {row['grads'] / mib:>9.2f} | {row['state'] / mib:>9.2f} | "
            f"{total / mib:>9.2f} | {total / base_total:>7.2f} | {row['step'] * 1e3:>7.1f} | "
            f"{row['step'] / base['step']:>6.2f}"
        )


if __name__ == "__main__":
    main()
