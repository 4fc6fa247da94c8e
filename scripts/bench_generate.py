"""Benchmark `generate()` at tp=2 on CPU/gloo: optimum_parallel against one process and transformers' own TP.

What it measures
    Greedy `generate` (KV cache, exactly `--new` new tokens) of a randomly initialised fp32 Llama (built from a
    config, no hub access) on one batch of prompts, for:

    1. a single process without parallelism, with 1 and with 2 intra-op threads;
    2. optimum_parallel at tp=2 (vocab-parallel head, full logits gathered for generate);
    3. transformers' own tensor parallelism: ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=2))``.

    prefill = the time of ``generate(max_new_tokens=1)`` (the prompt's forward and one token);
    decode = (time of ``generate(max_new_tokens=N)`` - prefill) / (N - 1), per new token of the batch.
    Tokens/s: prefill batch x prompt / prefill time, decode batch / decode time per step. The tp variants run on
    2 processes with one thread each (at most the 2 cores the 2-thread single process uses), built side by side
    and timed in rounds after a barrier (a slow spell of a shared machine falls on all alike); a time is the
    slowest rank's. Every variant's tokens are compared with the single process's.

How to run
    python scripts/bench_generate.py                                     # full size (a few minutes on 2 cores)
    python scripts/bench_generate.py --repeats 1 --layers 1 --prompt 32 --new 8     # quick smoke run
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import transformers
from _common import StepTimes, print_table, timed_rounds
from _ranks import run_on_ranks
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

TP = 2
PG_TIMEOUT = timedelta(seconds=120)
ATTN_IMPLEMENTATION = "sdpa"
GOAL_VS_TRANSFORMERS = 0.8  # decode time <= 0.8x transformers' tp=2
GOAL_VS_ONE_PROCESS = 1.0  # decode time <= one process's


@dataclass
class Result:
    name: str
    prefill_s: list[float] = field(default_factory=list)
    full_s: list[float] = field(default_factory=list)
    tokens: list[list[int]] | None = None
    error: str | None = None

    def prefill(self) -> float:
        return StepTimes(self.prefill_s).median

    def decode_step(self, new: int) -> float:
        return max(StepTimes(self.full_s).median - self.prefill(), 1e-9) / (new - 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=128, help="prompt length")
    parser.add_argument("--new", type=int, default=64, help="new tokens per sequence")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5, help="timed generate calls per variant and length")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=3600)
    return parser.parse_args(argv)


def model_config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11008 // 4096,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        vocab_size=args.vocab,
        max_position_embeddings=max(512, args.prompt + args.new),
        tie_word_embeddings=False,
    )


def build_model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(model_config(args), attn_implementation=ATTN_IMPLEMENTATION).float().eval()


def prompts(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(args.seed + 1)
    input_ids = torch.randint(3, args.vocab, (args.batch, args.prompt), generator=generator)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def generate(model: nn.Module, inputs: dict, new: int) -> torch.Tensor:
    options = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    return model.generate(**inputs, **options)


def measure(models: list[tuple[Result, nn.Module]], args: argparse.Namespace, barrier: bool) -> None:
    """Warm up, then `repeats` rounds of (prefill, full) generate calls, one of each model in turn."""
    inputs = prompts(args)
    for result, model in models:
        result.tokens = generate(model, inputs, args.new)[:, args.prompt :].tolist()
        for _ in range(args.warmup):
            generate(model, inputs, 1)
    calls = [lambda model=model, new=new: generate(model, inputs, new) for _, model in models for new in (1, args.new)]
    seconds = timed_rounds(calls, timed=args.repeats, before=dist.barrier if barrier else None)
    for i, (result, _) in enumerate(models):  # each model's prefill call, then its full one
        result.prefill_s, result.full_s = seconds[2 * i], seconds[2 * i + 1]


# --------------------------------------------------------------------------------------------------------------
# The tp=2 variants, on 2 processes


def prepare_optimum_parallel(args: argparse.Namespace, checkpoint: str) -> nn.Module:
    import optimum_parallel as op

    op.init_mesh(tp=TP, timeout=PG_TIMEOUT)
    model = build_model(args)
    return op.ParallelizersManager.parallelizer_for_model(model).parallelize(model)


def prepare_transformers(args: argparse.Namespace, checkpoint: str) -> nn.Module:
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(
        checkpoint,
        distributed_config=DistributedConfig(tp_size=TP),
        dtype=torch.float32,
        attn_implementation=ATTN_IMPLEMENTATION,
    )
    return model.eval()


VARIANTS = {
    "optimum_parallel tp=2": prepare_optimum_parallel,
    "transformers tp=2 (DistributedConfig)": prepare_transformers,
}


def rank_main(rank: int, world: int, args: argparse.Namespace, checkpoint: str) -> list[Result]:
    transformers.logging.set_verbosity_error()
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=PG_TIMEOUT)
    built, results = [], []
    for name, prepare in VARIANTS.items():
        result = Result(name)
        results.append(result)
        try:
            built.append((result, prepare(args, checkpoint)))
        except Exception as err:  # reported in the table, not fatal
            if rank == 0:
                traceback.print_exc()
            result.error = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"[:160]
    failed = torch.tensor([r.error is not None for r in results], dtype=torch.uint8)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    live = [(r, m) for r, m in built if not failed[results.index(r)]]
    measure(live, args, barrier=True)
    for result, _ in live:  # a time is the slowest rank's
        for times in (result.prefill_s, result.full_s):
            slowest = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times[:] = slowest.tolist()
    for result, bad in zip(results, failed.tolist(), strict=True):
        if bad and result.error is None:
            result.error = "failed on another rank"
    return results


# --------------------------------------------------------------------------------------------------------------
# Report


def print_report(args: argparse.Namespace, results: list[Result]) -> None:
    reference = results[0]
    by_name = {r.name: r for r in results}
    config = model_config(args)
    print()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, gloo, tp={TP}")
    print(
        f"Llama: hidden {config.hidden_size}, intermediate {config.intermediate_size}, {config.num_hidden_layers} "
        f"layers, {config.num_attention_heads} heads, vocab {config.vocab_size}, fp32, {ATTN_IMPLEMENTATION}; "
        f"batch {args.batch}, prompt {args.prompt}, {args.new} new tokens (greedy, KV cache); "
        f"medians of {args.repeats} calls"
    )
    print("decode ratio = decode time per token / that of the row named (lower is faster)")
    print()
    header = (
        "variant",
        "prefill tok/s",
        "decode tok/s",
        "decode ms/step",
        "x 1 process (1 thread)",
        "x 1 process (2 threads)",
        "x transformers tp=2",
        "tokens match",
    )
    rows = []
    baselines = ("single process, 1 thread", "single process, 2 threads", "transformers tp=2 (DistributedConfig)")

    def ratio(result: Result, name: str) -> str:
        other = by_name.get(name)
        if other is None or other.error is not None or not other.full_s:
            return "n/a"
        return f"{result.decode_step(args.new) / other.decode_step(args.new):.2f}x"

    for result in results:
        if result.error is not None:
            rows.append((result.name, f"failed: {result.error}", *[""] * (len(header) - 2)))
            continue
        step = result.decode_step(args.new)
        rows.append(
            (
                result.name,
                f"{args.batch * args.prompt / result.prefill():.0f}",
                f"{args.batch / step:.0f}",
                f"{step * 1e3:.2f}",
                *(ratio(result, name) for name in baselines),
                "reference" if result is reference else ("yes" if result.tokens == reference.tokens else "NO"),
            )
        )
    print_table(header, rows)
    print()
    ours, theirs = by_name["optimum_parallel tp=2"], by_name["transformers tp=2 (DistributedConfig)"]
    if ours.error is not None or ours.tokens != reference.tokens:
        print("goal: FAIL (optimum_parallel failed or generated other tokens than one process)")
        return
    for label, other, goal in (
        ("transformers tp=2", theirs, GOAL_VS_TRANSFORMERS),
        ("1 process (2 threads)", by_name["single process, 2 threads"], GOAL_VS_ONE_PROCESS),
        ("1 process (1 thread)", by_name["single process, 1 thread"], GOAL_VS_ONE_PROCESS),
    ):
        if other.error is not None:
            print(f"goal: decode <= {goal}x {label}: n/a ({other.error})")
            continue
        value = ours.decode_step(args.new) / other.decode_step(args.new)
        print(f"goal: decode <= {goal}x {label}: {'PASS' if value <= goal else 'FAIL'} (ratio {value:.2f})")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    transformers.logging.set_verbosity_error()
    results = []
    for threads in (1, 2):
        print(f"single process, {threads} thread(s) ...", file=sys.stderr, flush=True)
        torch.set_num_threads(threads)
        result = Result(f"single process, {threads} thread{'s' * (threads > 1)}")
        measure([(result, build_model(args))], args, barrier=False)
        results.append(result)
    print(f"tp={TP} variants on {TP} processes ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_generate_") as checkpoint:
        build_model(args).save_pretrained(checkpoint)
        try:
            results += run_on_ranks(TP, rank_main, (args, checkpoint), args.deadline, f"tp={TP} variants")
        except (RuntimeError, TimeoutError) as err:
            print(err, file=sys.stderr)
            results += [Result(name, error=(str(err).splitlines() or [""])[0][:160]) for name in VARIANTS]
    print_report(args, results)


if __name__ == "__main__":
    main()
