"""Benchmark tensor parallelism (tp=2) on CPU/gloo: optimum_parallel against torch DTensor and transformers.

What it measures
    The wall-clock time of one training step (forward + backward + zero_grad, no optimizer update) of a
    randomly initialised fp32 Llama (built from a config, no hub access) on the same batch, for:

    1. a single process without parallelism, with 1 and with 2 intra-op threads (the reference);
    2. optimum_parallel at tp=2 (module swapping on local tensors, vocab-parallel LM head and loss), with its
       tp collectives through shared memory (the default for ranks of one host) and through gloo's sockets;
    3. torch's own ``parallelize_module`` (DTensor) at tp=2, with the plan a user would write for HF Llama,
       once with the LM head gathering the full logits and once with ``loss_parallel``;
    4. transformers' own tensor parallelism: ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=2))``.

    Each distributed variant runs on 2 processes with one thread each, so every row uses at most the 2 cores
    the single-process 2-thread row uses. A distributed step starts after a ``dist.barrier()`` and its time is the
    slowest rank's. Before timing, every variant's loss is compared with the single-process loss. The
    distributed variants are built side by side and timed in rounds (one step of each, in turn), so a slow
    spell of a shared machine falls on all of them alike and the ratios between them hold.

How to run
    python scripts/bench_tp.py                                      # full size (a few minutes on 2 cores)
    python scripts/bench_tp.py --steps 3 --warmup 1 --layers 1 --seq 64   # quick smoke run

The script launches its own 2 worker processes (torch.multiprocessing, spawn, a free port on 127.0.0.1);
only the parent prints. Timings on a shared machine are noisy: compare medians, and rerun when in doubt.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from unittest import mock

import torch
import torch.distributed as dist
import transformers
from _common import (
    Batch,
    StepResult,
    add_llama_args,
    add_run_args,
    build_llama,
    llama_config,
    print_table,
    quiet_transformers,
    random_batch,
    timed_rounds,
    timed_steps,
)
from _ranks import run_on_ranks
from torch import nn
from transformers import AutoModelForCausalLM

TP = 2
PG_TIMEOUT = timedelta(seconds=90)
ATTN_IMPLEMENTATION = "sdpa"
LOSS_RTOL = 1e-5  # |loss - reference| <= LOSS_RTOL * max(1, |reference|)
GOAL_RATIO = 0.8  # optimum_parallel must take <= 0.8x the time of the best of torch DTensor / transformers

StepContext = Callable[[], contextlib.AbstractContextManager]  # entered around forward + backward
Prepared = tuple[nn.Module, StepContext]


# --------------------------------------------------------------------------------------------------------------
# Model, batch, timing


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps per variant (default 3)")
    parser.add_argument("--batch", type=int, default=4)
    add_llama_args(parser, seq=256, heads_help="attention heads (= kv heads)")
    add_run_args(parser, deadline=3600, deadline_help="seconds before the workers are killed")
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace) -> nn.Module:
    return build_llama(args, ATTN_IMPLEMENTATION)


def make_batch(args: argparse.Namespace) -> Batch:
    return random_batch(args.vocab, args.batch, args.seq, args.seed)


def loss_value(loss: torch.Tensor) -> float:
    """A (possibly DTensor) scalar loss as a Python float."""
    if hasattr(loss, "full_tensor"):
        loss = loss.full_tensor()
    return loss.item()


def train_step(model: nn.Module, batch: Batch, context: StepContext) -> torch.Tensor:
    with context():
        loss = model(**batch).loss
        loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.detach()


def time_steps(model: nn.Module, batch: Batch, args: argparse.Namespace, context: StepContext) -> list[float]:
    """Warm up, then time `args.steps` steps (one process), in ms."""
    seconds = timed_steps(lambda: train_step(model, batch, context), timed=args.steps, warmup=args.warmup)
    return [s * 1e3 for s in seconds]


def build_variant(name: str, prepare: Callable[[], Prepared], batch: Batch) -> tuple[StepResult, Prepared | None]:
    """Build one variant and take its first step (its loss is the correctness check); a failure is recorded."""
    try:
        model, context = prepare()
        return StepResult(name, loss=loss_value(train_step(model, batch, context))), (model, context)
    except Exception as err:  # a failed variant is reported in the table, not fatal
        if not dist.is_initialized() or dist.get_rank() == 0:
            traceback.print_exc()
        message = (str(err).strip().splitlines() or [""])[0]
        return StepResult(name, error=f"{type(err).__name__}: {message}"[:160]), None


# --------------------------------------------------------------------------------------------------------------
# The variants


def prepare_single(args: argparse.Namespace, threads: int) -> Prepared:
    torch.set_num_threads(threads)
    return build_model(args), contextlib.nullcontext


def prepare_optimum_parallel(args: argparse.Namespace, shared_memory: bool = True) -> Prepared:
    """With `shared_memory=False` the tp group keeps gloo's sockets (as under OPTIMUM_PARALLEL_SHM=0)."""
    import optimum_parallel as op
    from optimum_parallel.comm import collectives as comm

    mesh = op.init_mesh(tp=TP, timeout=PG_TIMEOUT)
    with mock.patch.dict(os.environ, OPTIMUM_PARALLEL_SHM="1" if shared_memory else "0"):
        comm.all_reduce(torch.zeros(1), mesh.tp_group)  # a group picks its transport on its first collective
    model = build_model(args)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    return parallelizer.parallelize(model), contextlib.nullcontext


def prepare_torch_dtensor(args: argparse.Namespace, loss_parallel: bool) -> Prepared:
    """torch's parallelize_module with the usual Llama plan (as in torchtitan).

    Attention needs no change: HF views q/k/v as (batch, seq, -1, head_dim), so each rank runs its local heads.
    The LM head either gathers the full logits (every rank computes the whole loss) or, with `loss_parallel`,
    keeps them vocab-sharded and computes the cross-entropy on the shards.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_context

    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    model = build_model(args)
    layer_plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer, mesh, layer_plan)
    if loss_parallel:
        lm_head = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    else:
        lm_head = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(
        model,
        mesh,
        {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": lm_head,
        },
    )
    return model, (loss_parallel_context if loss_parallel else contextlib.nullcontext)


def prepare_transformers(args: argparse.Namespace, checkpoint: str) -> Prepared:
    """transformers' own TP: its Llama plan (colwise/rowwise layers, vocab-sharded embedding, gathered logits)."""
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(
        checkpoint,
        distributed_config=DistributedConfig(tp_size=TP),
        dtype=torch.float32,
        attn_implementation=ATTN_IMPLEMENTATION,
    )
    return model.train(), contextlib.nullcontext


def distributed_variants(args: argparse.Namespace, checkpoint: str) -> dict[str, Callable[[], Prepared]]:
    return {
        "optimum_parallel tp=2": lambda: prepare_optimum_parallel(args),
        "optimum_parallel tp=2, gloo sockets (OPTIMUM_PARALLEL_SHM=0)": lambda: prepare_optimum_parallel(
            args, shared_memory=False
        ),
        "torch DTensor tp=2 (lm_head gathers logits)": lambda: prepare_torch_dtensor(args, loss_parallel=False),
        "torch DTensor tp=2 (loss_parallel)": lambda: prepare_torch_dtensor(args, loss_parallel=True),
        "transformers tp=2 (DistributedConfig)": lambda: prepare_transformers(args, checkpoint),
    }


# --------------------------------------------------------------------------------------------------------------
# Processes


def rank_main(rank: int, world: int, args: argparse.Namespace, checkpoint: str) -> list[StepResult]:
    """One tp rank: build every distributed variant, then time them in rounds (rank 0's results are reported)."""
    quiet_transformers()
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=PG_TIMEOUT)
    batch = make_batch(args)
    variants = distributed_variants(args, checkpoint)
    built = [build_variant(name, prepare, batch) for name, prepare in variants.items()]
    failed = torch.tensor([prepared is None for _, prepared in built], dtype=torch.uint8)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)  # a variant that failed on any rank is left out on all
    live = [(result, prepared) for (result, prepared), bad in zip(built, failed.tolist(), strict=True) if not bad]
    steps = [lambda model=model, context=context: train_step(model, batch, context) for _, (model, context) in live]
    rounds = timed_rounds(steps, timed=args.steps, warmup=args.warmup, before=dist.barrier, across_ranks=True)
    for (result, _), seconds in zip(live, rounds, strict=True):  # a step's time is the slowest rank's
        result.times_ms = [s * 1e3 for s in seconds]
    for (result, _), bad in zip(built, failed.tolist(), strict=True):
        if bad and result.error is None:
            result.error = "failed on another rank"
    return [result for result, _ in built]


def run_distributed(args: argparse.Namespace, checkpoint: str) -> list[StepResult]:
    """The distributed variants on TP spawned ranks; if the ranks die or run past the deadline, every variant
    is reported as failed with the reason."""
    try:
        return run_on_ranks(TP, rank_main, (args, checkpoint), args.deadline, f"tp={TP} variants")
    except (RuntimeError, TimeoutError) as err:
        print(err, file=sys.stderr)
        reason = (str(err).splitlines() or [""])[0][:160]
        return [StepResult(name, error=reason) for name in distributed_variants(args, checkpoint)]


# --------------------------------------------------------------------------------------------------------------
# Report


def loss_matches(result: StepResult, reference: float) -> bool:
    return result.loss is not None and abs(result.loss - reference) <= LOSS_RTOL * max(1.0, abs(reference))


def best_baseline(results: list[StepResult], reference: float) -> StepResult | None:
    """The fastest correct torch DTensor or transformers run."""
    baselines = [
        r
        for r in results
        if r.name.startswith(("torch", "transformers")) and r.error is None and loss_matches(r, reference)
    ]
    return min(baselines, key=lambda r: r.median, default=None)


def print_report(args: argparse.Namespace, results: list[StepResult]) -> None:
    single, reference = results[0], results[0].loss
    best = best_baseline(results, reference) if reference is not None else None
    config = llama_config(args)
    print()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, gloo, tp={TP}, {os.cpu_count()} CPUs")
    print(
        f"Llama: hidden {config.hidden_size}, intermediate {config.intermediate_size}, "
        f"{config.num_hidden_layers} layers, {config.num_attention_heads} heads, vocab {config.vocab_size}, "
        f"fp32, {ATTN_IMPLEMENTATION}; batch {args.batch} x seq {args.seq}; "
        f"step = forward + backward + zero_grad; {args.steps} timed steps after {args.warmup} warm-up"
    )
    print("ratios are median time / reference median time (lower is faster); timings on a busy machine are noisy")
    print()
    header = (
        "variant",
        "median ms",
        "p90 ms",
        "x single(1 thread)",
        "x best-of-(torch DTensor, transformers)",
        "loss matches",
    )
    rows = []
    for result in results:
        if result.error is not None:
            rows.append((result.name, f"failed: {result.error}", "", "", "", ""))
            continue
        delta = abs(result.loss - reference) if reference is not None else float("nan")
        match = "reference" if result is single else f"{'yes' if loss_matches(result, reference) else 'NO'}"
        rows.append(
            (
                result.name,
                f"{result.median:.1f}",
                f"{result.p90:.1f}",
                f"{result.median / single.median:.2f}x" if single.error is None else "n/a",
                f"{result.median / best.median:.2f}x" if best is not None else "n/a",
                f"{match} (loss {result.loss:.6f}, |diff| {delta:.1e})",
            )
        )
    print_table(header, rows)
    print()
    ours = next(r for r in results if r.name.startswith("optimum_parallel"))
    if best is None or ours.error is not None or not loss_matches(ours, reference):
        print(f"goal: optimum_parallel <= {GOAL_RATIO}x best of torch/transformers: FAIL (no valid comparison)")
        return
    ratio = ours.median / best.median
    verdict = "PASS" if ratio <= GOAL_RATIO else "FAIL"
    print(
        f"goal: optimum_parallel <= {GOAL_RATIO}x best of torch/transformers: {verdict} "
        f"(ratio {ratio:.2f}, best = {best.name})"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet_transformers()
    batch = make_batch(args)
    print("single process ...", file=sys.stderr, flush=True)
    results = []
    for threads in (1, 2):
        name = f"single process, {threads} thread{'s' * (threads > 1)}"
        result, prepared = build_variant(name, lambda threads=threads: prepare_single(args, threads), batch)
        if prepared is not None:
            model, context = prepared
            result.times_ms = time_steps(model, batch, args, context)
        results.append(result)
    print(f"tp={TP} variants on {TP} processes ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_tp_") as checkpoint:
        build_model(args).save_pretrained(checkpoint)
        results += run_distributed(args, checkpoint)
    print_report(args, results)


if __name__ == "__main__":
    main()
