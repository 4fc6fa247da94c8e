"""One accelerator, one process: a ~1B Llama training step with optimum_parallel at tp=1 against plain transformers.

What it measures
    The wall-clock time of one training step (forward, backward, AdamW step, zero_grad) of a randomly initialised
    Llama (hidden 2048, 16 layers, MLP 8192, 32 heads, 8 kv heads, vocab 32000: 1.1B parameters) in bf16 on a
    batch of 4 x 2048 tokens, for four variants built from the same weights:

    1. plain transformers, eager;
    2. optimum_parallel at tp=1 (its tensor-parallel layers, vocabulary-parallel embedding, head and loss, no
       sequence parallelism; the Parallelizer, the process group on the device's own backend), eager;
    3. and 4.: the same two with every decoder layer compiled (`layer.compile()`, torch.compile's default inductor).

    Each variant runs --warmup steps, then --steps timed steps (the median is reported), with the device synchronised
    around each step. Tokens/s = batch x seq / step time. MFU = model FLOPs per step / step time / the card's dense
    bf16 peak (looked up from the device name: H100 SXM and H200 989 TFLOP/s, H100 PCIe 756, H100 NVL 835, A100 312;
    --peak-tflops for another card), with the model FLOPs of a training step (forward and backward) counted as
    PaLM's appendix B and torchtitan do: 6 x the parameters that multiply (every one but the embedding table, a
    lookup) x tokens, plus the attention scores and their weighted sum, 12 x layers x heads x head_dim x seq x tokens
    (the full square: causal masking's skipped half is counted, as everyone quoting MFU does). Peak memory is the
    variant's own: the device's peak during the variant minus what was allocated before it (after gc.collect() and
    empty_cache(); the shared source model is in that base).

    A mismatch -- a variant's first-step loss more than --loss-rtol (bf16: 2e-2) from the reference row's (the
    first variant that ran: plain transformers eager, or the next one if it failed; the title and each row name it),
    a non-finite loss, or a variant that fails -- is printed in the table and makes the exit status 1. With --junit
    (a pytest JUnit XML file, repeatable; scripts/device_check.sh passes the accelerator lane's) the table also holds
    each lane run's counts and failing tests, and any failure there makes the exit status 1 too; --lane-only prints
    just those rows. --budget-s: variants that would start past it are skipped (and named), and an interrupt
    (SIGINT, as `timeout -s INT` sends) ends the current one; either way the table is printed.

How to run
    python scripts/bench_single_gpu.py                       # on a CUDA GPU: the ~1B model (about 3 minutes, H100)
    python scripts/bench_single_gpu.py --device cpu --hidden 128 --intermediate 256 --layers 2 --heads 4 \\
        --kv-heads 2 --vocab 512 --seq 64 --batch 2 --steps 2 --warmup 1 --dtype float32   # smoke run, no GPU
    python scripts/bench_single_gpu.py --lane-only --junit "lane=device-check-logs/lane.xml"   # the lane's table
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import sys
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass

import torch
from _common import now, print_table, quiet_transformers, timed_steps, train_step
from transformers import AutoModelForCausalLM, LlamaConfig

PEAK_BF16_TFLOPS = [  # dense bf16 tensor-core peak by device name (first match wins)
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM (e.g. "NVIDIA H100 80GB HBM3")
    ("H200", 989.0),
    ("GH200", 989.0),
    ("A100", 312.0),
]


@dataclass
class Row:
    check: str
    result: str = ""
    step_ms: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_gib: float | None = None
    loss: float | None = None
    failed: bool = False


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    parser.add_argument("--no-compile", action="store_true", help="eager variants only")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the card's dense peak, for MFU")
    parser.add_argument("--loss-rtol", type=float, default=2e-2, help="first-step loss against plain eager's")
    parser.add_argument("--junit", action="append", default=[], metavar="LABEL=FILE", help="lane results to show")
    parser.add_argument("--cut", action="append", default=[], metavar="LABEL=NOTE", help="a lane run stopped early")
    parser.add_argument("--lane-only", action="store_true", help="print the lane rows (--junit) and exit")
    parser.add_argument("--budget-s", type=float, default=None, help="start no variant past this many seconds")
    return parser.parse_args()


def lane_rows(specs: list[str], cuts: list[str] = ()) -> list[Row]:
    """A row per JUnit file (LABEL=FILE): its counts, then one row per failing or skipped test; a run named in
    `cuts` (LABEL=NOTE: stopped at its time budget) is failed, with the note."""
    rows = []
    cut = dict(c.split("=", 1) for c in cuts if "=" in c)
    for spec in specs:
        label, _, path = spec.rpartition("=")
        label = label or os.path.basename(path)
        if label in cut:
            rows.append(Row(f"lane: {label}", f"STOPPED: {cut[label]}"[:34], failed=True))
        if not os.path.exists(path) or os.path.getsize(path) == 0:
            if label not in cut:
                rows.append(Row(f"lane: {label}", "no result (pytest crashed?)", failed=True))
            continue
        cases = ET.parse(path).getroot().iter("testcase")
        counts, listed = {"passed": 0, "failed": 0, "skipped": 0}, []
        for case in cases:
            found = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
            outcome = "passed" if found is None else "skipped" if found.tag == "skipped" else "failed"
            counts[outcome] += 1
            if found is not None:  # each failing test, and each skipped one with its reason
                reason = (found.get("message") or "").splitlines()[0] if found.get("message") else ""
                listed.append(Row(f"  {outcome.upper()} {case.get('name')}", reason[:34], failed=outcome == "failed"))
        result = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
        failed = counts["failed"] > 0 or not any(counts.values()) or label in cut
        if label in cut:  # the case running at the interrupt may be written as passed: say what the counts are
            result = f"before the stop: {result}"
        rows += [Row(f"lane: {label}", result or "no tests", failed=failed), *listed]
    return rows


def peak_flops(device: torch.device, override: float | None) -> tuple[float | None, str]:
    if override is not None:
        return override * 1e12, f"{override:g} TFLOP/s (given)"
    if device.type == "cpu":
        return None, "cpu"
    name = torch.get_device_module(device.type).get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12, f"{name}: {tflops:g} TFLOP/s dense bf16"
    return None, f"{name}: peak unknown (--peak-tflops)"


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def own_peak_gib(device: torch.device, base: int) -> float | None:
    """The variant's own peak: the device's peak since `reset_memory` minus what was allocated before (`base`)."""
    return None if device.type == "cpu" else (torch.accelerator.max_memory_allocated(device) - base) / 2**30


def reset_memory(device: torch.device) -> int:
    """Free what the previous variant left (gc, the allocator's cache), reset the peak; the bytes still allocated."""
    gc.collect()
    if device.type == "cpu":
        return 0
    torch.accelerator.synchronize(device)
    torch.accelerator.empty_cache()
    torch.accelerator.reset_peak_memory_stats(device)
    return torch.accelerator.memory_allocated(device)


def step_flops(model: torch.nn.Module, args: argparse.Namespace) -> float:
    """Model FLOPs of one training step: 6 x multiplying parameters x tokens (not the embedding table: a lookup)
    plus attention's 12 x layers x heads x head_dim x seq x tokens (see the module docstring)."""
    embedding = model.get_input_embeddings().weight.numel()
    params = sum(p.numel() for p in model.parameters()) - embedding
    tokens = args.batch * args.seq
    head_dim = args.hidden // args.heads
    attention = 12 * args.layers * args.heads * head_dim * args.seq
    return (6 * params + attention) * tokens


def build_source(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=max(2048, args.seq),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=getattr(torch, args.dtype))
    return model.train()


def make_variant(source: torch.nn.Module, ours: bool, compiled: bool, device: torch.device) -> torch.nn.Module:
    model = copy.deepcopy(source)
    if ours:
        import optimum_parallel as op

        parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
        model = parallelizer.parallelize(model, device=device, sequence_parallel_enabled=False)
    if compiled:
        for layer in model.model.layers:
            layer.compile()
    return model


def run_variant(model, batch: dict, args: argparse.Namespace, device: torch.device) -> tuple[float, list[float]]:
    """(median step seconds, the losses of every step)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.1)
    losses = []

    def step() -> None:
        losses.append(train_step(model, batch, optimizer))
        synchronize(device)  # the step ends when the device is done

    times = timed_steps(step, timed=args.steps, warmup=args.warmup, before=lambda: synchronize(device))
    return times.median, [loss.item() for loss in losses]


HEADER = ("check", "result", "step ms", "tokens/s", "MFU", "peak GiB", "loss")


def print_rows(rows: list[Row], title: str) -> None:
    """The table under its title, through `_common.print_table` (so `scripts/bench.py single_gpu --json` has it)."""

    def fmt(value, spec: str) -> str:
        return "" if value is None else format(value, spec)

    cells = [
        (r.check, r.result, fmt(r.step_ms, ".1f"), fmt(r.tokens_per_s, ".0f"),
         "" if r.mfu is None else f"{100 * r.mfu:.1f}%", fmt(r.peak_gib, ".2f"), fmt(r.loss, ".4f"))
        for r in rows
    ]  # fmt: skip
    print(f"\n{title}")
    print_table(HEADER, cells, align_numbers=True, title=title)


def lane_only(args: argparse.Namespace) -> int:
    rows = lane_rows(args.junit, args.cut)
    print_rows(rows, "accelerator lane")
    failed = [r.check.strip() for r in rows if r.failed]
    print(f"\n{'FAILED: ' + '; '.join(failed) if failed else 'lane passed'}")
    return 1 if failed else 0


def main() -> int:
    args = parse_args()
    if args.lane_only:
        return lane_only(args)
    started = now()  # the benchmarks' one clock (scripts/_common.py)
    quiet_transformers()
    rows = lane_rows(args.junit, args.cut)
    title = ["device check"]
    try:
        run_benchmark(args, rows, title, started)
    except KeyboardInterrupt:  # the budget ran out before the variants (timeout -s INT): the table still prints
        rows.append(Row("benchmark set-up", "STOPPED: interrupted (budget)", failed=True))
    except Exception as err:
        traceback.print_exc()
        rows.append(Row("benchmark set-up", f"FAILED: {type(err).__name__}: {err}"[:34], failed=True))
    print_rows(rows, title[0])
    failed = [r.check.strip() for r in rows if r.failed]
    print(f"\n{'FAILED: ' + '; '.join(failed) if failed else 'all checks passed'}")
    print(f"benchmark wall time {now() - started:.0f} s")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 1 if failed else 0


def run_benchmark(args: argparse.Namespace, rows: list[Row], title: list[str], started: float) -> None:
    """Every variant's row appended to `rows`; `title[0]` set to the table's title (device, model, reference)."""
    device = torch.device(args.device)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index or 0)
        device = torch.device(device.type, torch.accelerator.current_device_index())
    peak, peak_note = peak_flops(device, args.peak_tflops)
    tokens = args.batch * args.seq
    title[0] = f"device check on {peak_note} | torch {torch.__version__}"
    import optimum_parallel as op

    mesh = op.init_mesh(tp=1, device=device.type)  # one rank on the device's own backend (NCCL on CUDA)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator).to(device)
    batch = {"input_ids": input_ids, "labels": input_ids}
    source = build_source(args, device)
    params = sum(p.numel() for p in source.parameters())
    flops = step_flops(source, args)
    reference: tuple[str, float] | None = None  # (label, first-step loss) of the first variant that ran
    variants = [("transformers", False, False), ("optimum_parallel tp=1", True, False)]
    if not args.no_compile:
        variants += [("transformers", False, True), ("optimum_parallel tp=1", True, True)]
    took = {False: 0.0, True: 0.0}  # the longest eager and compiled variant so far (seconds)
    for name, ours, compiled in variants:
        label = f"{name}, {'compiled' if compiled else 'eager'}"
        elapsed = now() - started
        guess = took[compiled] or 2 * took[False]  # a first compiled variant: twice an eager one
        if args.budget_s is not None and elapsed + guess > args.budget_s:
            rows.append(Row(label, f"SKIPPED: budget {args.budget_s:g} s", failed=True))
            continue
        base = reset_memory(device)
        variant_started = now()
        model = None
        try:
            model = make_variant(source, ours, compiled, device)
            seconds, losses = run_variant(model, batch, args, device)
        except KeyboardInterrupt:  # the part's time budget ran out (timeout -s INT): the table still prints
            rows.append(Row(label, "STOPPED: interrupted (budget)", failed=True))
            break
        except Exception as err:  # shown in the table; the exit status says it failed
            traceback.print_exc()
            rows.append(Row(label, f"FAILED: {type(err).__name__}: {err}"[:34], failed=True))
            continue
        finally:
            model = None
            took[compiled] = max(took[compiled], now() - variant_started)
        first = losses[0]
        reference = reference or (label, first)
        diff = abs(first - reference[1]) / abs(reference[1])
        bad = not all(math.isfinite(x) for x in losses) or diff > args.loss_rtol
        result = (
            f"{'MISMATCH' if bad else 'ok'}: loss {diff:.1e} vs reference" if reference[0] != label else "reference row"
        )
        rows.append(
            Row(label, result, 1e3 * seconds, tokens / seconds, flops / seconds / peak if peak else None,
                own_peak_gib(device, base), first, failed=bad)
        )  # fmt: skip
    refer = f"loss reference row: {reference[0]}" if reference else "no variant ran: no loss reference"
    title[0] = (
        f"device check on {peak_note} | torch {torch.__version__} | mesh backend "
        f"{torch.distributed.get_backend(mesh.group('tp'))} | Llama {params / 1e9:.2f}B params, {args.dtype}, "
        f"batch {args.batch} x seq {args.seq} = {tokens} tokens, median of {args.steps} steps after {args.warmup} | "
        f"MFU at {flops / 1e12:.1f} TFLOP per step (6 x non-embedding params + attention) | peak GiB: the variant's "
        f"own | {refer}"
    )


if __name__ == "__main__":
    sys.exit(main())
