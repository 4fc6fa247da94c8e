"""Benchmark expert parallelism (ep=2) against tensor parallelism (tp=2) and one process, on CPU/gloo.

A random fp32 Mixtral (8 experts, top-2, hidden 512, 4 layers by default), AdamW, the same global batch in every
layout: one process runs all of it, tp=2 runs all of it on both ranks (each holds half of every expert's
intermediate features), ep=2 (dp=2) gives each rank half the rows (each holds 4 whole experts, tokens reach them by
all-to-all). Per layout: the median step time (forward, backward, AdamW step; the slowest rank per step) and, per
rank (the most of any rank), the bytes of the expert weights and of their AdamW state. The experts run through
transformers' default experts implementation, `grouped_mm` (torch's grouped GEMM, which has a CPU kernel here).

How to run
    OMP_NUM_THREADS=1 python scripts/bench_moe.py [--steps 5] [--hidden 512] [--layers 4] [--seq 128]

On a 2-core machine both ranks share the 2 cores: compare step times within one run only.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _common import (  # noqa: E402
    add_run_args,
    print_table,
    quiet_transformers,
    random_batch,
    tensor_bytes,
    timed_steps,
    train_step,
)
from _ranks import run_on_ranks  # noqa: E402

LAYOUTS = {"one process": (1, {}), "tp=2": (2, {"dp": 1, "tp": 2}), "ep=2": (2, {"dp": 2, "ep": 2})}


def build_mixtral(args: argparse.Namespace):
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        num_local_experts=args.experts,
        num_experts_per_tok=2,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()


def rank_main(rank: int, world: int, sizes: dict, args: argparse.Namespace) -> dict:
    import optimum_parallel as op
    from optimum_parallel.expert_parallel import find_experts

    quiet_transformers()
    model = build_mixtral(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = random_batch(args.vocab, args.batch, args.seq, args.seed)
    if sizes:
        mesh = op.init_mesh(**sizes)
        if mesh.size("ep") > 1:
            model, optimizer = op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": 0}})
            rows = args.batch // mesh.data_parallel_size
            batch = {k: v[rank * rows : (rank + 1) * rows] for k, v in batch.items()}
        else:
            parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
            model = parallelizer.parallelize(model)
            optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
    barrier = dist.barrier if world > 1 else None
    step = partial(train_step, model, batch, optimizer)
    times = timed_steps(step, timed=args.steps, warmup=args.warmup, before=barrier, across_ranks=True)
    experts = [p for _, module in find_experts(model) for p in module.parameters(recurse=False)]
    state = [v for p in experts for v in optimizer.state[p].values() if torch.is_tensor(v) and v.dim() > 0]
    sizes_t = torch.tensor([tensor_bytes(experts), tensor_bytes(state)], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(sizes_t, op=dist.ReduceOp.MAX)
    return {"experts": sizes_t[0].item(), "state": sizes_t[1].item(), "step": times.median}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(parser, deadline=900, deadline_help="seconds before the workers are killed")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="rows of the global batch")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    rows = {
        name: run_on_ranks(world, rank_main, (sizes, args), args.deadline, name)
        for name, (world, sizes) in LAYOUTS.items()
    }
    base = rows["one process"]
    mib = 1024**2
    print(
        f"Mixtral {args.experts} experts top-2, hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}, "
        f"global batch {args.batch} x {args.seq}, AdamW; per rank (the most of any rank), median of {args.steps} steps"
    )
    header = ("layout", "experts MiB", "AdamW MiB", "step ms", "x step")
    table = [
        (
            name,
            f"{row['experts'] / mib:.2f}",
            f"{row['state'] / mib:.2f}",
            f"{row['step'] * 1e3:.1f}",
            f"{row['step'] / base['step']:.2f}",
        )
        for name, row in rows.items()
    ]
    print_table(header, table, align_numbers=True)


if __name__ == "__main__":
    main()
