"""One accelerator, one process: a ~1B Llama training step with optimum_parallel at tp=1 against plain transformers.

What it measures
    The wall-clock time of one training step (forward, backward, AdamW step, zero_grad) of a randomly initialised
    Llama (hidden 2048, 16 layers, MLP 8192, 32 heads, 8 kv heads, vocab 32000: 1.1B parameters) in bf16 on a
    batch of 4 x 2048 tokens, for four variants built from the same weights:

    1. plain transformers, eager;
    2. optimum_parallel at tp=1 (its tensor-parallel layers, vocabulary-parallel embedding, head and loss, no
       sequence parallelism; the Parallelizer front door, the process group on the device's own backend), eager;
    3. and 4.: the same two with every decoder layer compiled (`layer.compile()`, torch.compile's default inductor).

    Each variant runs --warmup steps, then --steps timed steps (the median is reported), with the device synchronised
    around each step. Tokens/s = batch x seq / step time. MFU = 6 x parameters x tokens / step time / the card's
    dense bf16 peak (looked up from the device name: H100 SXM and H200 989 TFLOP/s, H100 PCIe 756, H100 NVL 835,
    A100 312; --peak-tflops for another card). Peak memory is the device's max_memory_allocated over the variant.

    A mismatch -- a variant's first-step loss more than --loss-rtol (bf16: 2e-2) from plain eager's, a non-finite
    loss, or a variant that fails -- is printed in the table and makes the exit status 1. With --junit (a pytest
    JUnit XML file, repeatable; scripts/device_check.sh passes the accelerator lane's) the table also holds each
    lane run's counts and failing tests, and any failure there makes the exit status 1 too.

How to run
    python scripts/bench_single_gpu.py                       # on a CUDA GPU: the ~1B model (about 3 minutes, H100)
    python scripts/bench_single_gpu.py --device cpu --hidden 128 --intermediate 256 --layers 2 --heads 4 \\
        --kv-heads 2 --vocab 512 --seq 64 --batch 2 --steps 2 --warmup 1 --dtype float32   # smoke run, no GPU
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass

import torch
from _common import quiet_transformers
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
    return parser.parse_args()


def lane_rows(specs: list[str]) -> list[Row]:
    """A row per JUnit file (LABEL=FILE): its counts, then one row per failing or skipped test."""
    rows = []
    for spec in specs:
        label, _, path = spec.rpartition("=")
        label = label or os.path.basename(path)
        if not os.path.exists(path):
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
        failed = counts["failed"] > 0 or not any(counts.values())
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


def max_memory(device: torch.device) -> float | None:
    return None if device.type == "cpu" else torch.accelerator.max_memory_allocated(device) / 2**30


def reset_memory(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.empty_cache()
        torch.accelerator.reset_peak_memory_stats(device)


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
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        synchronize(device)
        start = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return statistics.median(times), losses


def print_table(rows: list[Row], title: str) -> None:
    def fmt(value, spec: str) -> str:
        return "" if value is None else format(value, spec)

    header = f"{'check':<44} | {'result':<34} | {'step ms':>8} | {'tokens/s':>9} | {'MFU':>6} | {'peak GiB':>8} | loss"
    print(f"\n{title}\n{header}\n{'-' * len(header)}")
    for r in rows:
        mfu = None if r.mfu is None else f"{100 * r.mfu:.1f}%"
        print(
            f"{r.check:<44} | {r.result:<34} | {fmt(r.step_ms, '8.1f'):>8} | {fmt(r.tokens_per_s, '9.0f'):>9} | "
            f"{mfu or '':>6} | {fmt(r.peak_gib, '8.2f'):>8} | {fmt(r.loss, '.4f')}"
        )


def main() -> int:
    args = parse_args()
    quiet_transformers()
    rows = lane_rows(args.junit)
    device = torch.device(args.device)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index or 0)
        device = torch.device(device.type, torch.accelerator.current_device_index())
    peak, peak_note = peak_flops(device, args.peak_tflops)
    tokens = args.batch * args.seq
    import optimum_parallel as op

    mesh = op.init_mesh(tp=1, device=device.type)  # one rank on the device's own backend (NCCL on CUDA)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator).to(device)
    batch = {"input_ids": input_ids, "labels": input_ids}
    source = build_source(args, device)
    params = sum(p.numel() for p in source.parameters())
    reference_loss = None
    variants = [("transformers", False, False), ("optimum_parallel tp=1", True, False)]
    if not args.no_compile:
        variants += [("transformers", False, True), ("optimum_parallel tp=1", True, True)]
    for name, ours, compiled in variants:
        label = f"{name}, {'compiled' if compiled else 'eager'}"
        reset_memory(device)
        try:
            model = make_variant(source, ours, compiled, device)
            seconds, losses = run_variant(model, batch, args, device)
        except Exception as err:  # shown in the table; the exit status says it failed
            traceback.print_exc()
            rows.append(Row(label, f"FAILED: {type(err).__name__}: {err}"[:34], failed=True))
            continue
        finally:
            model = None
        first = losses[0]
        reference_loss = first if reference_loss is None else reference_loss
        diff = abs(first - reference_loss) / abs(reference_loss)
        bad = not all(math.isfinite(x) for x in losses) or diff > args.loss_rtol
        result = f"{'MISMATCH' if bad else 'ok'}: loss {diff:.1e} from plain eager"
        flops = 6 * params * tokens / seconds
        rows.append(
            Row(label, result, 1e3 * seconds, tokens / seconds, flops / peak if peak else None, max_memory(device),
                first, failed=bad)
        )  # fmt: skip
    title = (
        f"device check on {peak_note} | torch {torch.__version__} | mesh backend "
        f"{torch.distributed.get_backend(mesh.group('tp'))} | Llama {params / 1e9:.2f}B params, {args.dtype}, "
        f"batch {args.batch} x seq {args.seq} = {tokens} tokens, median of {args.steps} steps after {args.warmup}"
    )
    print_table(rows, title)
    failed = [r.check.strip() for r in rows if r.failed]
    print(f"\n{'FAILED: ' + '; '.join(failed) if failed else 'all checks passed'}")
    torch.distributed.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
