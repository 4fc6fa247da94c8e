"""Benchmark torch.compile on tensor parallelism (tp=2, and tp=2 + sp) on CPU/gloo, side by side with one process.

What it measures
    For each Llama (built from a config, random fp32 weights, no hub access), the wall-clock time of one training
    step (forward + backward + zero_grad, no optimizer update, `use_cache=False`) and the time of the first step
    (which compiles), for:

    1. one process, one thread: eager, and each decoder layer compiled (`layer.compile()`, inductor), as a user of
       plain transformers would;
    2. optimum_parallel at tp=2 (2 processes, one thread each): eager and `compile=True` (each decoder block compiled
       by inductor, `engine/compile.py`), and the same with sequence parallelism.

    The one-process variants run on rank 0 while rank 1 waits (one core each, as each tp rank has); the tp variants
    are built side by side and timed in rounds (one step of each in turn, a distributed step's time is the slowest
    rank's), so a slow spell of a shared machine falls on all of them alike. Inductor's caches are off
    (TORCHINDUCTOR_FORCE_DISABLE_CACHES=1, unless --cache), so every first step compiles from scratch.

The goals (issue 35), per model:
    - compiled tp=2 step <= 1.05x the ideal: one process compiled, divided by 2;
    - compiling speeds tp=2 up at least as much as it speeds up one process: (tp=2 eager / tp=2 compiled) /
      (one process eager / one process compiled) >= 0.95;
    - the first step's compile time (first step - median step) at tp=2 <= 2x one process's.

How to run
    python scripts/bench_compile.py                                  # the three models of issue 35 (~11 min here)
    python scripts/bench_compile.py --models small --steps 3 --warmup 1   # a quick run
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta

if "--cache" not in sys.argv:
    os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # inherited by the spawned ranks

import torch
import torch.distributed as dist
import transformers
from _common import (
    StepResult,
    Stopwatch,
    build_llama,
    llama_config,
    print_table,
    quiet_transformers,
    random_batch,
    slowest_rank,
    timed_rounds,
)
from _ranks import run_on_ranks

TP = 2
PG_TIMEOUT = timedelta(seconds=3600)  # rank 1 waits while rank 0 runs the one-process variants
LOSS_RTOL = 1e-4
GOAL_IDEAL, GOAL_SPEEDUP, GOAL_COMPILE = 1.05, 0.95, 2.0
MODELS = {  # issue 35's three Llamas: hidden, layers, seq, vocab
    "small": dict(hidden=256, layers=2, seq=128, vocab=512),
    "medium": dict(hidden=512, layers=4, seq=256, vocab=8192),
    "large": dict(hidden=1024, layers=4, seq=512, vocab=8192),
}


@dataclass
class Result(StepResult):
    first_ms: float | None = None

    @property
    def compile_s(self) -> float:
        """The first step's time beyond a steady step's: what compiling took."""
        return (self.first_ms - self.median) / 1e3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="small,medium,large", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per variant (default 6)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the first (default 2)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", action="store_true", help="keep inductor's caches (first steps then hit them)")
    parser.add_argument("--deadline", type=float, default=3600, help="seconds per model before the ranks are killed")
    return parser.parse_args(argv)


def model_args(args: argparse.Namespace, name: str) -> argparse.Namespace:
    return argparse.Namespace(**MODELS[name], intermediate=None, heads=args.heads, seed=args.seed, batch=args.batch)


def step(model, batch) -> torch.Tensor:
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.detach()


def first_step(result: Result, model, batch, sync: bool) -> None:
    """The first step (the compile, for a compiled variant): its time and loss; with `sync`, started by every rank
    together (the one-process variants run on rank 0 alone: a barrier there would meet rank 1's wait)."""
    if sync:
        dist.barrier()
    with Stopwatch() as watch:
        result.loss = step(model, batch).item()
    result.first_ms = watch.seconds * 1e3


def single_variants(margs: argparse.Namespace, batch) -> list[Result]:
    """One process, one thread: eager and every decoder layer compiled, timed in rounds."""
    torch.set_num_threads(1)
    eager, compiled = Result("one process, eager"), Result("one process, layer.compile() (inductor)")
    models = [build_llama(margs, "sdpa"), build_llama(margs, "sdpa")]
    for layer in models[1].model.layers:
        layer.compile()
    for result, model in zip((eager, compiled), models, strict=True):
        first_step(result, model, batch, sync=False)
    steps = [lambda model=model: step(model, batch) for model in models]
    rounds = timed_rounds(steps, timed=margs.steps, warmup=margs.warmup)
    for result, seconds in zip((eager, compiled), rounds, strict=True):
        result.times_ms = [s * 1e3 for s in seconds]
    return [eager, compiled]


def tp_variants(margs: argparse.Namespace, batch) -> list[Result]:
    """tp=2 eager and compiled, without and with sp, built side by side and timed in rounds."""
    import optimum_parallel as op

    op.init_mesh(tp=TP, timeout=PG_TIMEOUT)
    specs = [
        ("tp=2, eager", False, False),
        ("tp=2, compile=True", False, True),
        ("tp=2 + sp, eager", True, False),
        ("tp=2 + sp, compile=True", True, True),
    ]
    live = []
    results = []
    for name, sequence_parallel, compile_ in specs:
        result = Result(name)
        results.append(result)
        try:
            model = build_llama(margs, "sdpa")
            model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(
                model, sequence_parallel_enabled=sequence_parallel, compile=compile_, shared_batch="trust"
            )
            first_step(result, model, batch, sync=True)
            live.append((result, model))
        except Exception as err:  # a failed variant is reported in the table
            if dist.get_rank() == 0:
                traceback.print_exc()
            result.error = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"[:160]
            raise
    steps = [lambda model=model: step(model, batch) for _, model in live]
    rounds = timed_rounds(steps, timed=margs.steps, warmup=margs.warmup, before=dist.barrier)
    for (result, _), seconds in zip(live, rounds, strict=True):
        result.times_ms = [s * 1e3 for s in seconds]
    for result in results:  # a step's time is the slowest rank's
        slowest = slowest_rank([result.first_ms or 0.0, *result.times_ms])
        result.first_ms, result.times_ms = slowest[0], slowest[1:]
    return results


def rank_main(rank: int, world: int, margs: argparse.Namespace) -> list[Result]:
    quiet_transformers()
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=PG_TIMEOUT)
    batch = random_batch(margs.vocab, margs.batch, margs.seq, margs.seed)
    single = single_variants(margs, batch) if rank == 0 else []
    dist.barrier()  # rank 1 waits (blocked in gloo, not spinning) while rank 0 runs the one-process variants
    torch._dynamo.reset()
    return single + tp_variants(margs, batch)


def goals(results: dict[str, Result]) -> list[str]:
    eager, compiled = results["one process, eager"], results["one process, layer.compile() (inductor)"]
    lines = []
    ideal = compiled.median / TP
    for prefix in ("tp=2", "tp=2 + sp"):
        tp_eager, tp_compiled = results[f"{prefix}, eager"], results[f"{prefix}, compile=True"]
        ratio = tp_compiled.median / ideal
        speedups = (tp_eager.median / tp_compiled.median) / (eager.median / compiled.median)
        compile_ratio = tp_compiled.compile_s / max(compiled.compile_s, 1e-9)
        checks = (
            (f"compiled {prefix} step / ideal (one process compiled / 2)", ratio, "<=", GOAL_IDEAL),
            (f"compile speed-up at {prefix} / at one process", speedups, ">=", GOAL_SPEEDUP),
            (f"compile time {prefix} / one process", compile_ratio, "<=", GOAL_COMPILE),
        )
        for text, value, sign, goal in checks:
            ok = value <= goal if sign == "<=" else value >= goal
            lines.append(f"  {text}: {value:.2f} (goal {sign} {goal}): {'PASS' if ok else 'MISS'}")
    return lines


def print_model(name: str, margs: argparse.Namespace, results: list[Result]) -> None:
    config = llama_config(margs)
    reference = results[0].loss
    print()
    print(
        f"{name}: Llama hidden {config.hidden_size}, intermediate {config.intermediate_size}, "
        f"{config.num_hidden_layers} layers, {config.num_attention_heads} heads, vocab {config.vocab_size}; "
        f"batch {margs.batch} x seq {margs.seq}"
    )
    header = ("variant", "first step s", "compile s", "median ms", "min ms", "x one process compiled / 2", "loss")
    rows = []
    ideal = results[1].median / TP if results[1].error is None else None
    for result in results:
        if result.error is not None:
            rows.append((result.name, f"failed: {result.error}", "", "", "", "", ""))
            continue
        compiled = "compile" in result.name
        match = abs(result.loss - reference) <= LOSS_RTOL * max(1.0, abs(reference))
        rows.append(
            (
                result.name,
                f"{result.first_ms / 1e3:.1f}",
                f"{result.compile_s:.1f}" if compiled else "",
                f"{result.median:.1f}",
                f"{min(result.times_ms):.1f}",
                f"{result.median / ideal:.2f}x" if ideal else "n/a",
                f"{result.loss:.6f}{'' if match else ' (differs)'}",
            )
        )
    print_table(header, rows, title=name)
    if all(r.error is None for r in results):
        print("\n".join(goals({r.name: r for r in results})))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet_transformers()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, gloo, tp={TP}, {os.cpu_count()} CPUs, "
        f"inductor caches {'on' if args.cache else 'off'}; fp32, sdpa; step = forward + backward + zero_grad; "
        f"{args.steps} timed steps after the first and {args.warmup} warm-up"
    )
    for name in args.models.split(","):
        margs = model_args(args, name)
        margs.steps, margs.warmup = args.steps, args.warmup
        print(f"{name} ...", file=sys.stderr, flush=True)
        results = run_on_ranks(TP, rank_main, (margs,), args.deadline, f"{name} model")
        print_model(name, margs, results)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
