"""LoRA fine-tuning step time and per-rank memory: this engine at tp=2 vs one process (PEFT) vs full fine-tuning
at tp=2, in one run.

    python scripts/bench_lora.py                  # Llama hidden 512, 4 layers, seq 256, batch 4, vocab 8192, r=16

Each variant runs forward + backward + AdamW on the same random batch; the table gives the median step time
over --steps timed steps (after --warmup), the ratios, and what one rank holds: parameters, trainable
parameters and AdamW state. The LoRA variants must agree on the first loss (printed).
"""

from __future__ import annotations

import argparse

import torch
from _common import (
    add_llama_args,
    add_run_args,
    build_llama,
    print_table,
    quiet_transformers,
    random_batch,
    tensor_bytes,
    timed_steps,
    train_step,
)
from _ranks import run_on_ranks

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_llama_args(parser, seq=256)
    add_run_args(parser, deadline=900, deadline_help="seconds before the tp=2 workers are killed")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank r")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    return parser.parse_args(argv)


def _model(args: argparse.Namespace, lora: bool):
    from peft import LoraConfig, get_peft_model

    model = build_llama(args, "sdpa")
    if lora:
        torch.manual_seed(args.seed + 7)
        config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS, lora_dropout=0.0)
        model = get_peft_model(model, config)
    return model


def _train(model, args: argparse.Namespace) -> dict:
    batch = random_batch(args.vocab, args.batch, args.seq, args.seed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    losses = []
    times = timed_steps(
        lambda: losses.append(train_step(model, batch, optimizer)), timed=args.steps, warmup=args.warmup
    )
    state = [t for s in optimizer.state.values() for t in s.values()]
    return {
        "ms": times.median * 1e3,
        "params": tensor_bytes(model.parameters()),
        "trainable": tensor_bytes(trainable),
        "optimizer": tensor_bytes(state),
        "loss": losses[0].item(),
    }


def single(args: argparse.Namespace, threads: int) -> dict:
    torch.set_num_threads(threads)
    return _train(_model(args, lora=True), args)


def tp_rank(rank: int, world: int, lora: bool, args: argparse.Namespace) -> dict:
    import optimum_parallel as op

    quiet_transformers()
    op.init_mesh(tp=world)
    model = _model(args, lora)
    model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(model)
    return _train(model, args)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet_transformers()
    rows = [
        ("one process, LoRA (PEFT), 1 thread", single(args, 1)),
        ("one process, LoRA (PEFT), 2 threads", single(args, 2)),
        ("optimum_parallel tp=2, LoRA", run_on_ranks(2, tp_rank, (True, args), args.deadline, "LoRA tp=2")),
        ("optimum_parallel tp=2, full fine-tuning", run_on_ranks(2, tp_rank, (False, args), args.deadline, "full")),
    ]
    best_single = min(r["ms"] for name, r in rows if name.startswith("one process"))
    full = rows[-1][1]["ms"]
    mib = 1024**2
    print(
        f"Llama hidden {args.hidden}, {args.layers} layers, seq {args.seq}, batch {args.batch}, vocab {args.vocab}; "
        f"LoRA r={args.rank} on {', '.join(TARGETS)}; median of {args.steps} steps after {args.warmup}\n"
    )
    header = (
        "variant",
        "step ms",
        "x best one-process",
        "x full FT tp=2",
        "params MiB/rank",
        "trainable MiB",
        "AdamW MiB",
    )
    table = [
        (
            name,
            f"{r['ms']:.1f}",
            f"{r['ms'] / best_single:.2f}x",
            f"{r['ms'] / full:.2f}x",
            f"{r['params'] / mib:.1f}",
            f"{r['trainable'] / mib:.2f}",
            f"{r['optimizer'] / mib:.2f}",
        )
        for name, r in rows
    ]
    print_table(header, table, align_numbers=True)
    lora_losses = [r["loss"] for name, r in rows if "LoRA" in name]
    print(
        f"\nfirst LoRA losses: {', '.join(f'{x:.6f}' for x in lora_losses)} "
        f"(max |diff| {max(lora_losses) - min(lora_losses):.1e})"
    )


if __name__ == "__main__":
    main()
