"""Context parallelism: per-rank activation memory and step time against sequence length, cp=1 vs cp=2, in one run.

    python scripts/bench_context.py                       # Llama hidden 256, 2 layers, 4 heads, 1k-16k tokens
    python scripts/bench_context.py --lengths 1024 4096   # shorter run

cp=1 is one process running the transformers model with sdpa (torch's fused CPU flash attention, O(seq) memory);
cp=2 is this engine on two processes (ring attention). Every process has one intra-op thread; a one-process row
with two threads is printed as well. Activation memory is what autograd saves for the backward (the unique
storages packed by `saved_tensors_hooks`, parameters excluded), after the forward: the figure that grows with the
sequence. Peak RSS is the process's high-water mark over the step (reset before it), model and optimizer included.
Goals (issue 15), at the longest length: activations per rank <= 0.55x of cp=1, step time <= 0.6x of one process.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from _common import (
    add_llama_args,
    add_run_args,
    build_llama,
    llama_config,
    print_table,
    proc_status_bytes,
    quiet_transformers,
    timed_steps,
)
from _ranks import run_on_ranks

MIB = 1024**2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_llama_args(parser, seq=16384, layers=2, vocab=4096)
    parser.set_defaults(hidden=256, heads=4)
    add_run_args(parser, deadline=1800, deadline_help="seconds before the cp=2 workers are killed")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--steps", type=int, default=2, help="timed steps per length (median), after one warm-up")
    return parser.parse_args(argv)


class SavedActivations:
    """Bytes autograd keeps for the backward while the block runs (unique storages, parameters excluded)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.params and tensor.device.type != "meta":
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := VmRSS


def _steps(model, args: argparse.Namespace, length: int) -> dict:
    generator = torch.Generator().manual_seed(args.seed + length)
    input_ids = torch.randint(0, args.vocab, (1, length), generator=generator)
    batch = {"input_ids": input_ids, "labels": input_ids.clone()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rss, saved, peak, losses = [], [], [], []  # per step, the warm-up's first

    def before() -> None:  # untimed: the peak RSS restarts from the current RSS
        _reset_peak_rss()
        rss.append(proc_status_bytes("VmRSS"))

    def step() -> None:
        watch = SavedActivations(model)
        with watch.hooks():
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        peak.append(proc_status_bytes("VmHWM") - rss[-1])
        saved.append(watch.bytes)
        losses.append(loss.detach())

    times = timed_steps(step, timed=args.steps, warmup=1, before=before)
    return {"ms": times.median * 1e3, "saved": max(saved[1:]), "peak": max(peak[1:]), "loss": losses[0].item()}


def one_process(args: argparse.Namespace, threads: int) -> dict[int, dict]:
    torch.set_num_threads(threads)
    config = llama_config(args, max(args.lengths))
    return {
        length: _progress(
            f"one process, {threads} thread(s)", length, _steps(build_llama(args, "sdpa", config), args, length)
        )
        for length in args.lengths
    }


def _progress(what: str, length: int, result: dict) -> dict:
    print(f"  {what}, {length} tokens: {result['ms']:.0f} ms, {result['saved'] / MIB:.1f} MiB saved", flush=True)
    return result


def cp_rank(rank: int, world: int, args: argparse.Namespace) -> dict[int, dict]:
    import optimum_parallel as op

    quiet_transformers()
    mesh = op.init_mesh(cp=world, tp=1)
    results = {}
    for length in args.lengths:
        model = build_llama(args, "sdpa", llama_config(args, max(args.lengths)))
        model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(model)
        model, _ = op.parallelize(model, None, mesh, {"dp_config": {"sharding_level": 0}})  # gradients over cp
        result = _steps(model, args, length)
        results[length] = _progress("cp=2", length, result) if rank == 0 else result
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet_transformers()
    single = one_process(args, 1)
    single2 = one_process(args, 2)
    cp2 = run_on_ranks(2, cp_rank, (args,), args.deadline, "cp=2")
    print(
        f"Llama hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocab {args.vocab}, batch 1, fp32, "
        f"AdamW; median of {args.steps} steps after 1; per-rank figures\n"
    )
    header = (
        "tokens",
        "cp=1 ms (1 thread)",
        "cp=1 ms (2 threads)",
        "cp=2 ms",
        "x cp=1 (1 thread)",
        "x cp=1 (2 threads)",
        "cp=1 activations MiB",
        "cp=2 activations MiB",
        "x cp=1",
        "cp=1 peak RSS MiB",
        "cp=2 peak RSS MiB",
        "loss diff",
    )
    rows = []
    for length in args.lengths:
        a, a2, b = single[length], single2[length], cp2[length]
        rows.append(
            (
                length,
                f"{a['ms']:.0f}",
                f"{a2['ms']:.0f}",
                f"{b['ms']:.0f}",
                f"{b['ms'] / a['ms']:.2f}x",
                f"{b['ms'] / a2['ms']:.2f}x",
                f"{a['saved'] / MIB:.1f}",
                f"{b['saved'] / MIB:.1f}",
                f"{b['saved'] / a['saved']:.2f}x",
                f"{a['peak'] / MIB:.0f}",
                f"{b['peak'] / MIB:.0f}",
                f"{abs(a['loss'] - b['loss']):.1e}",
            )
        )
    print_table(header, rows, align_numbers=True)
    longest = max(args.lengths)
    memory = cp2[longest]["saved"] / single[longest]["saved"]
    speed = cp2[longest]["ms"] / single[longest]["ms"]
    print(f"\nactivations at {longest} tokens: {memory:.2f}x of cp=1 ({'PASS' if memory <= 0.55 else 'FAIL'} <= 0.55)")
    print(f"step time at {longest} tokens: {speed:.2f}x of one process ({'PASS' if speed <= 0.6 else 'FAIL'} <= 0.6)")


if __name__ == "__main__":
    main()
