"""Benchmark the pipeline bubble on CPU/gloo: the fraction of each pipeline rank's step time spent idle, for pp=2 and
pp=4 and several micro-batch counts, next to the theoretical bubble of the schedule.

What it measures
    A randomly initialised fp32 Llama (no hub access; 8 decoder layers so that interleaved schedules get at least
    2 stages per rank at pp=4) is split with `Parallelizer.parallelize(..., pipeline_parallel_schedule=...)` and
    trained with `model.run_train` on m micro-batches of a fixed size (--mb-rows x --seq tokens), so the work per
    micro-batch (and the compute / communication ratio) is the same in every row. For every schedule, pp and m:
        step ms        median over --steps steps (after --warmup) of the wall time from a barrier before
                       `run_train` to a barrier after it (the pipeline's whole forward + backward + loss broadcast);
        busy           per rank, the wall time spent inside the stage computations of its stages;
        idle fraction  per rank 1 - busy / step (median over steps); the table gives the max and the mean over ranks;
        theory         the bubble fraction of an ideal pipeline (equal stages, free communication):
                         GPipe, 1F1B:              (p-1) / (m+p-1)
                         interleaved 1F1B:         (p-1) / (v*m+p-1), v = stages per rank
                       (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
                       Megatron-LM", section 2.2: bubble time / ideal time = (p-1)/m, or (1/v)(p-1)/m interleaved;
                       as a fraction of the whole step that is (p-1)/(m+p-1) and (p-1)/(v*m+p-1));
                         zero-bubble (ZB-V):       ~0 for enough micro-batches, if forward, input-backward and
                       weight-backward take the same time (Qi et al. 2024, "Zero Bubble Pipeline Parallelism",
                       section 6). "Enough" is taken here as m >= 2p (an assumption of this script, not a formula from
                       the paper); below that the theory column says "n/a" and the row is not judged;
        comm           an estimate of the communication on the critical path, as a fraction of the step:
                       2 x (cross-rank stage boundaries) x (one-way p2p time of one activation, measured by ping-pong
                       between ranks 0 and 1 before the runs) / step. It charges every boundary of the forward and the
                       backward path once; interleaving multiplies the boundaries by v (Narayanan et al. 2021).
    The goal of the issue is "within 10% of theory plus communication"; it is read here as
        max-over-ranks idle fraction <= theory + comm + --tolerance (default 0.10, i.e. 10 points of the step),
    and judged row by row in the last column ("ok" or "over by x"), with "(cores shared)" added where a rank got
    less than --min-cpu-share of a core inside its computations (see cpu/wall below).

How it measures
    On every rank, the bound methods `forward_one_chunk`, `backward_one_chunk` and `backward_weight_one_chunk` of the
    `torch.distributed.pipelining.PipelineStage` objects and the `_compute_loss` of the torch schedule the pipeline
    steps with are wrapped with timers (wall clock and thread CPU time); the pipeline builds that schedule, over torch
    stages of its own, per batch shape on first use (`Pipeline._schedule_for`), and each is wrapped as it is handed out.
    These are exactly the stage computations (the schedule waits for its p2p receives outside them), so everything else
    in the step is idle: waiting on a neighbour, p2p transfers, the schedule's own Python, the final loss broadcast and
    barrier. The column "cpu/wall" is the lowest ratio, over ranks, of CPU time to wall time inside the computations:
    1.00 means the rank had its core to itself, 0.5 that it ran half of the time. The load average before each group of
    processes and at the end is printed too: other work on the machine slows ranks unevenly and shows up as idle time.

Caveats
    - This machine has 2 cores. pp=2 is one single-threaded process per core. pp=4 puts 4 processes on 2 cores: a
      rank waiting on its neighbour gives its core to another rank, so the computations of the busy ranks stretch
      (cpu/wall < 1), busy wall time includes time spent descheduled, and the idle fraction mixes the bubble with
      CPU contention. The pp=4 rows are printed, marked "(2 cores)", and should not be read as a bubble measurement.
    - The last stage also runs the final norm, the LM head and the loss (kept small with --vocab), the first the
      embedding: the stages are not exactly equal, which the theory assumes. "busy ms" shows it per rank.
    - gloo p2p on loopback is cheap next to a stage's compute at the default size; on a GPU the ratio differs.

How to run
    python scripts/bench_pipeline.py                          # default size, about 2-4 minutes on 2 cores
    python scripts/bench_pipeline.py --hidden 256 --steps 2   # quicker
    python scripts/bench_pipeline.py --pp 2 --schedules 1f1b zbv --microbatches-pp2 4 8 16

The script starts its own worker processes (torch.multiprocessing spawn, gloo on a free 127.0.0.1 port, one thread
each, 120 s process-group timeout), one group of pp processes per pp value, and runs every case of that pp in it;
the parent prints rank 0's results.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import transformers
from _common import (
    add_llama_args,
    add_run_args,
    build_llama,
    now,
    print_table,
    quiet_transformers,
    random_batch,
    timed_steps,
)
from _ranks import run_on_ranks
from torch import nn

PG_TIMEOUT_S = 120
ZERO_BUBBLE = ("zbv", "interleaved_zb")
ALL_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv")
TIMED_STAGE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


@dataclass(frozen=True)
class Case:
    schedule: str
    pp: int
    m: int


@dataclass
class CaseResult:
    """Rank 0's summary of one case: per-rank medians over the measured steps."""

    case: Case
    v: int  # stages per rank
    boundaries: int  # cross-rank stage boundaries along the forward path
    step_ms: float
    idle: list[float]  # per rank
    busy_ms: list[float]  # per rank
    cpu_per_wall: list[float]  # per rank
    p2p_ms: float  # one-way time of one activation message


# --------------------------------------------------------------------------------------------------------------
# Arguments, model, batch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", nargs="+", type=int, choices=(2, 4), default=[2, 4])
    parser.add_argument("--schedules", nargs="+", choices=ALL_SCHEDULES, default=["gpipe", "1f1b", "interleaved_1f1b"])
    parser.add_argument(
        "--zero-bubble", nargs="*", choices=ZERO_BUBBLE, default=["zbv"], help="zero-bubble schedules, run at pp=2"
    )
    parser.add_argument("--microbatches-pp2", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--microbatches-pp4", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--mb-rows", type=int, default=1, help="rows per micro-batch (the batch is m x this)")
    add_llama_args(
        parser,
        seq=128,
        layers=8,
        vocab=1024,
        vocab_help="small, so the last stage's head stays light",
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4, help="measured steps per case (median)")
    parser.add_argument("--tolerance", type=float, default=0.10, help="allowed idle above theory + comm (fraction)")
    parser.add_argument(
        "--min-cpu-share",
        type=float,
        default=0.8,
        help="rows where a rank got less CPU than this inside its computations are marked 'cores shared'",
    )
    add_run_args(parser, deadline=600, deadline_help="seconds before a worker group is killed")
    args = parser.parse_args(argv)
    if args.layers < 2 * max(args.pp):
        parser.error(f"--layers {args.layers}: 2-stages-per-rank schedules need at least 2 x pp = {2 * max(args.pp)}")
    return args


def cases_for(pp: int, args: argparse.Namespace) -> list[Case]:
    """Every schedule x micro-batch count at this pp; zero-bubble schedules only at pp=2."""
    counts = args.microbatches_pp2 if pp == 2 else args.microbatches_pp4
    schedules = list(args.schedules) + ([s for s in args.zero_bubble if s not in args.schedules] if pp == 2 else [])
    return [Case(schedule, pp, m) for schedule in schedules for m in counts if m >= pp]


def build_model(args: argparse.Namespace) -> nn.Module:
    return build_llama(args, "sdpa")


def make_input_ids(args: argparse.Namespace, m: int) -> torch.Tensor:
    return random_batch(args.vocab, m * args.mb_rows, args.seq, args.seed)["input_ids"]


# --------------------------------------------------------------------------------------------------------------
# Timing on one rank


class BusyTimer:
    """Sums the wall and thread-CPU time spent inside the wrapped stage computations of this rank."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0

    def reset(self) -> None:
        self.wall = self.cpu = 0.0

    def wrap(self, owner: object, name: str) -> None:
        inner: Callable = getattr(owner, name)

        def timed(*args, **kwargs):
            wall, cpu = now(), time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.wall += now() - wall
                self.cpu += time.thread_time() - cpu

        setattr(owner, name, timed)  # an instance attribute: shadows the bound method on this object only

    def wrap_schedule(self, schedule: object) -> None:
        """Time the forward, backward (input) and backward (weight) of the schedule's torch stages, and its loss."""
        stages = getattr(schedule, "_stages", None) or [schedule._stage]  # multi-stage schedules, or one stage
        for stage in stages:
            for name in TIMED_STAGE_METHODS:
                self.wrap(stage, name)
        self.wrap(schedule, "_compute_loss")

    @classmethod
    def attach(cls, pipeline: object) -> BusyTimer:
        """Time every schedule the pipeline steps with. The pipeline builds one torch schedule (over torch stages of
        its own) per batch shape, on first use (`Pipeline._schedule_for`): each is wrapped when first handed out."""
        timer = cls()
        schedule_for = pipeline._schedule_for
        wrapped: set[int] = set()  # ids of the schedules already timed (a schedule is kept and handed out again)

        def timed_schedule_for(key):
            schedule = schedule_for(key)
            if id(schedule) not in wrapped:
                wrapped.add(id(schedule))
                timer.wrap_schedule(schedule)
            return schedule

        pipeline._schedule_for = timed_schedule_for  # an instance attribute: shadows the method on this pipeline
        return timer


def measure_p2p_ms(args: argparse.Namespace, rounds: int = 20) -> float:
    """One-way time of one activation message (mb_rows x seq x hidden fp32) between ranks 0 and 1 (median)."""
    rank = dist.get_rank()
    payload = torch.randn(args.mb_rows, args.seq, args.hidden)

    def round_trip() -> None:
        if rank == 0:
            dist.send(payload, dst=1)
            dist.recv(payload, src=1)
        elif rank == 1:
            dist.recv(payload, src=0)
            dist.send(payload, dst=0)

    return timed_steps(round_trip, timed=rounds, warmup=2, before=dist.barrier).median / 2 * 1e3


def run_case(args: argparse.Namespace, case: Case, p2p_ms: float) -> CaseResult | None:
    """Build, split and train the model for `--warmup + --steps` steps; rank 0 returns the summary."""
    import optimum_parallel as op

    model = build_model(args)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    with contextlib.redirect_stdout(io.StringIO()):  # the split is printed by the package; the table says enough
        model = parallelizer.parallelize(
            model, pipeline_parallel_num_microbatches=case.m, pipeline_parallel_schedule=case.schedule
        )
    pipeline = op.parallel_state(model).pipeline
    timer = BusyTimer.attach(pipeline)
    input_ids = make_input_ids(args, case.m)
    busy: list[tuple[float, float]] = []  # (busy wall, busy cpu) seconds of every step, warm-up ones included

    def before() -> None:
        model.zero_grad(set_to_none=True)
        dist.barrier()
        timer.reset()

    def step() -> None:
        model.run_train(input_ids=input_ids, labels=input_ids)
        dist.barrier()
        busy.append((timer.wall, timer.cpu))

    seconds = timed_steps(step, timed=args.steps, warmup=args.warmup, before=before)
    samples = [(elapsed, *rest) for elapsed, rest in zip(seconds, busy[args.warmup :], strict=True)]
    model.zero_grad(set_to_none=True)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, samples)
    boundaries = sum(pipeline.owner(i) != pipeline.owner(i + 1) for i in range(pipeline.num_stages - 1))
    v = pipeline.num_stages // case.pp
    model = pipeline = timer = None  # freed before the next case (the closures above hold the names, not a del)
    gc.collect()
    if dist.get_rank() != 0:
        return None
    return summarize(case, v, boundaries, gathered, p2p_ms)


def summarize(
    case: Case, v: int, boundaries: int, per_rank: list[list[tuple[float, float, float]]], p2p_ms: float
) -> CaseResult:
    def median(values) -> float:
        return statistics.median(list(values))

    steps = len(per_rank[0])
    step_ms = median(max(rank[i][0] for rank in per_rank) for i in range(steps)) * 1e3
    return CaseResult(
        case=case,
        v=v,
        boundaries=boundaries,
        step_ms=step_ms,
        idle=[median(1 - busy / step for step, busy, _ in rank) for rank in per_rank],
        busy_ms=[median(busy for _, busy, _ in rank) * 1e3 for rank in per_rank],
        cpu_per_wall=[median(cpu / busy for _, busy, cpu in rank) for rank in per_rank],
        p2p_ms=p2p_ms,
    )


# --------------------------------------------------------------------------------------------------------------
# Processes


def cpu_cores() -> int:
    """Cores this process may run on (what `nproc` says)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def rank_main(rank: int, world: int, cases: list[Case], args: argparse.Namespace) -> list[CaseResult]:
    """One pipeline rank of a pp=world mesh: run every case (rank 0's results are the ones reported)."""
    import optimum_parallel as op

    quiet_transformers()
    op.init_mesh(pp=world, tp=1, timeout=PG_TIMEOUT_S)
    p2p_ms = measure_p2p_ms(args)
    out = []
    for case in cases:
        if rank == 0:
            print(f"  {case.schedule} pp={case.pp} m={case.m} ...", file=sys.stderr, flush=True)
        out.append(run_case(args, case, p2p_ms))
    return out


def launch(pp: int, cases: list[Case], args: argparse.Namespace) -> list[CaseResult]:
    """Run `cases` on pp spawned ranks and return rank 0's results; raise if a rank fails or the deadline passes."""
    return run_on_ranks(pp, rank_main, (cases, args), args.deadline, f"pp={pp}")


# --------------------------------------------------------------------------------------------------------------
# Theory and report


def theory(schedule: str, pp: int, m: int, v: int) -> float | None:
    """The ideal bubble as a fraction of the step (None where no formula applies)."""
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) / (m + pp - 1)
    if schedule == "interleaved_1f1b":
        return (pp - 1) / (v * m + pp - 1)
    if schedule in ZERO_BUBBLE:
        return 0.0 if m >= 2 * pp else None
    raise ValueError(f"no bubble formula for schedule {schedule!r}; known: {', '.join(ALL_SCHEDULES)}")


def comm_fraction(r: CaseResult) -> float:
    return 2 * r.boundaries * r.p2p_ms / r.step_ms


def shared_cores(r: CaseResult, min_cpu_share: float) -> bool:
    """A rank got less than `min_cpu_share` of a core inside its computations (other processes ran on it)."""
    return min(r.cpu_per_wall) < min_cpu_share


def verdict(r: CaseResult, tolerance: float, min_cpu_share: float) -> str:
    ideal = theory(r.case.schedule, r.case.pp, r.case.m, r.v)
    if ideal is None:
        return "no theory (m < 2p)"
    excess = max(r.idle) - ideal - comm_fraction(r)
    text = "ok" if excess <= tolerance else f"over by {excess - tolerance:.3f}"
    return text + (" (cores shared)" if shared_cores(r, min_cpu_share) else "")


def table_rows(results: list[CaseResult], tolerance: float, min_cpu_share: float) -> list[tuple[str, ...]]:
    rows = []
    for r in results:
        ideal = theory(r.case.schedule, r.case.pp, r.case.m, r.v)
        idle_max, idle_mean = max(r.idle), statistics.mean(r.idle)
        rows.append(
            (
                r.case.schedule,
                f"{r.case.pp}" + (f" ({cpu_cores()} cores)" if r.case.pp > cpu_cores() else ""),
                str(r.case.m),
                str(r.v),
                f"{r.step_ms:.0f}",
                f"{idle_max:.3f} / {idle_mean:.3f}",
                "n/a" if ideal is None else f"{ideal:.3f}",
                "n/a" if ideal is None else f"{idle_max - ideal:+.3f}",
                f"{comm_fraction(r):.3f}",
                " / ".join(f"{b:.0f}" for b in r.busy_ms),
                f"{min(r.cpu_per_wall):.2f}",
                verdict(r, tolerance, min_cpu_share),
            )
        )
    return rows


HEADER = (
    "schedule",
    "pp",
    "m",
    "v",
    "step ms",
    "idle max / mean",
    "theory",
    "idle - theory",
    "comm",
    "busy ms per rank",
    "cpu/wall",
    "within tol of theory+comm",
)


def print_assessment(results: list[CaseResult], args: argparse.Namespace) -> None:
    """One line per group of rows: how many are within tolerance, which are not, which could not be judged."""
    cores = cpu_cores()

    def summary(rows: list[CaseResult]) -> str:
        judged = [r for r in rows if theory(r.case.schedule, r.case.pp, r.case.m, r.v) is not None]
        verdicts = [verdict(r, args.tolerance, args.min_cpu_share) for r in judged]
        ok = [r for r, v in zip(judged, verdicts, strict=True) if v.startswith("ok")]
        over = [r for r, v in zip(judged, verdicts, strict=True) if v.startswith("over")]
        shared = sum(shared_cores(r, args.min_cpu_share) for r in judged)
        text = f"{len(ok)} of {len(judged)} rows with a formula within"
        if over:
            text += "; over: " + ", ".join(f"{r.case.schedule} m={r.case.m}" for r in over)
        if shared:
            text += f"; {shared} of {len(judged)} ran with a rank below {args.min_cpu_share:.2f} of a core"
        return text

    one_core = [r for r in results if r.case.pp <= cores]
    crowded = [r for r in results if r.case.pp > cores]
    print(f"\nAssessment (max-over-ranks idle <= theory + comm + {args.tolerance:.2f}):")
    if one_core:
        print(f"  pp <= {cores} (one core per rank): {summary(one_core)}.")
    if crowded:
        print(
            f"  pp > {cores} ({max(r.case.pp for r in crowded)} processes on {cores} cores): {summary(crowded)}; "
            "these rows measure the bubble plus CPU contention, not the schedule's bubble alone."
        )


def load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"


def print_report(args: argparse.Namespace, results: list[CaseResult], loads: list[str]) -> None:
    p2p = ", ".join(sorted({f"{r.p2p_ms:.2f} ms at pp={r.case.pp}" for r in results}))
    print(
        f"\nPipeline bubble: Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
        f"micro-batch {args.mb_rows} x {args.seq} tokens, fp32, 1 thread per rank; median of {args.steps} steps "
        f"after {args.warmup} warm-up.\nOne-way p2p of one activation: {p2p}. Load average (1/5/15 min) before each "
        f"group and at the end: {'; '.join(loads)} on {cpu_cores()} cores.\n"
    )
    print_table(HEADER, table_rows(results, args.tolerance, args.min_cpu_share), title="pipeline bubble")
    cores = cpu_cores()
    legend = [
        "",
        "idle = 1 - (time in this rank's stage forward / backward / loss) / step",
        "theory: GPipe and 1F1B (p-1)/(m+p-1); interleaved 1F1B (p-1)/(v*m+p-1) (Narayanan et al. 2021);",
        "        zero-bubble ~0 (Qi et al. 2024), taken for m >= 2p",
        "comm = 2 x cross-rank stage boundaries x one-way p2p / step (critical-path estimate)",
        "busy ms per rank: rank 0 (holds the first stage) first",
        "cpu/wall = lowest CPU share of a rank inside its computations (1.00 = it had its core;",
        f"        lower = other processes ran on it; below --min-cpu-share {args.min_cpu_share}: 'cores shared')",
    ]
    print("\n".join(legend))
    if any(r.case.pp > cores for r in results):
        print(
            f"pp > {cores} rows run {max(r.case.pp for r in results)} processes on {cores} cores: a waiting rank's "
            "core is used by another rank, busy time stretches (cpu/wall < 1) and idle mixes the bubble with CPU "
            "contention. They are distorted; do not read them as the schedule's bubble."
        )
    print_assessment(results, args)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, gloo, {cpu_cores()} CPUs", flush=True)
    results: list[CaseResult] = []
    loads = []
    for pp in args.pp:
        cases = cases_for(pp, args)
        loads.append(f"{load_average()} before pp={pp}")
        print(f"pp={pp}: {len(cases)} cases on {pp} processes ...", file=sys.stderr, flush=True)
        results += launch(pp, cases, args)
    loads.append(f"{load_average()} at the end")
    print_report(args, results, loads)


if __name__ == "__main__":
    main()
