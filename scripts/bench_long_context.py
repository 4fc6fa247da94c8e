"""Long sequences under context parallelism: a Qwen3.5-shaped hybrid against a Llama, cp=2 vs cp=1, step time and
peak activation memory per rank.

    python scripts/bench_long_context.py                                  # 8k, 16k, 32k tokens; ~40 min on 2 idle cores
    python scripts/bench_long_context.py --lengths 4096 --steps 1         # a quick look
    python scripts/bench_long_context.py --breakdown 16384 --raw-json build/bench_long_context.json

Models (random fp32 weights, the same in every process): the hybrid is transformers' Qwen3_5TextConfig
(model_type qwen3_5_text), 3 "linear_attention" layers (gated delta net, transformers' torch reference kernels:
no flash-linear-attention or causal-conv1d here) to 1 "full_attention" layer (Qwen3.5's gated attention), delta-net
heads 2 key x 4 value of 64 (so cp=2 splits them); the Llama has the same width, depth, attention heads, MLP and
vocabulary. cp=1 is the plain transformers model (attn_implementation="sdpa": torch's fused CPU flash kernel, O(seq)
memory) on one process. cp=2 is this package on two processes: `init_mesh(cp=2)`,
`ParallelizersManager.parallelizer_for_model(model).parallelize(model)`, then
`parallelize(model, None, mesh, {"dp_config": {"sharding_level": 0}})` (gradients summed over cp); attention runs
ring attention on the same flash kernel, each delta-net layer all-gathers the sequence, runs its cp-local half of the
heads on it and reduce-scatters its output (optimum_parallel/mixers/). Every process has OMP_NUM_THREADS=1 (cp=1 uses
one core, cp=2 two) and runs one configuration (model, tokens, cp) in a fresh process.

Step time: forward + backward of batch 1 (loss on every token), the slowest rank's, median of --steps after one
warm-up step; the AdamW step and zero_grad run between the timed steps, untimed. Every process runs with glibc's mmap
threshold fixed at 256 MiB (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ 512 MiB): with glibc's default, a block of
32 MiB or more is mapped and unmapped at every allocation, and the delta net's reference backward, which allocates
a zeroed tensor of the whole sequence's size for each 64-token chunk, runs 6x slower at 32k tokens with 4 heads
(cp=1) while its 2-head half (cp=2) stays below the limit: a cliff of the allocator, not of cp.
Peak activation memory: per rank (the larger of the two at cp=2), in fresh processes of their own started with
MALLOC_MMAP_THRESHOLD_=65536 (glibc maps every block of 64 KiB or more alone and unmaps it when freed, so the resident
set follows the live tensors; set at start: a threshold lowered later is not used while the heap has free chunks),
the rise of the resident set during the forward + backward after a warm-up step (and its AdamW step): VmHWM reset to
VmRSS (/proc/self/clear_refs) just before the step, read just after, minus VmRSS before it, i.e. above the model, its
AdamW state and the batch (the gradients, 4 bytes a parameter, are in it). Those processes' steps are slower and
untimed. On 8k tokens this figure is 100-190 MiB above the peak of live tensor bytes that torch.profiler's memory
events give (the small blocks left in glibc's heap, the process's own buffers), the same on both sides. The bytes
autograd saves for the backward (unique storages, parameters excluded) are printed beside it.
With --breakdown TOKENS, one more step per configuration of that length times each decoder layer's mixer
(linear_attn), attention (self_attn) and MLP, and the head, forward and backward (module hooks; the backward from the
output's gradient to the input's), collectives included, and attributes the saved bytes to them.
Goals (issue 46), cp=2 against cp=1, for the hybrid as for Llama: peak activation memory <= 0.55x, step time <= 0.65x.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import warnings
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from _common import (
    add_run_args,
    now,
    print_table,
    proc_status_bytes,
    quiet_transformers,
    random_batch,
    timed_steps,
)
from _ranks import run_on_ranks
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3_5TextConfig

MIB = 1024**2
MODELS = ("hybrid", "llama")
PARTS = ("linear_attn", "self_attn", "mlp", "lm_head")  # what --breakdown times; the rest is "other"
GOALS = {"time": 0.65, "memory": 0.55}
MALLOC_ENV = {  # the timing processes' and the memory processes'
    "time": {"MALLOC_MMAP_THRESHOLD_": str(256 * MIB), "MALLOC_TRIM_THRESHOLD_": str(512 * MIB)},
    "memory": {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024), "MALLOC_TRIM_THRESHOLD_": str(64 * 1024)},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4, help="every 4th layer is full attention in the hybrid")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (head dim: hidden / heads)")
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--linear-heads", type=int, nargs=2, default=[2, 4], metavar=("KEY", "VALUE"))
    parser.add_argument("--linear-head-dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per configuration (median), after 1")
    parser.add_argument(
        "--breakdown", type=int, default=None, metavar="TOKENS", help="one more step timing the layers' modules"
    )
    parser.add_argument(
        "--raw-json",
        type=Path,
        default=None,
        help="also write every figure, per rank, to this file (scripts/bench.py's --json writes the tables)",
    )
    add_run_args(parser, deadline=3600, deadline_help="seconds before one configuration's workers are killed")
    return parser.parse_args(argv)


def model_config(args: argparse.Namespace, kind: str, longest: int):
    common = dict(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        head_dim=args.hidden // args.heads,
        vocab_size=args.vocab,
        max_position_embeddings=longest,
        tie_word_embeddings=False,
    )
    if kind == "llama":
        return LlamaConfig(**common)
    layer_types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(args.layers)]
    keys, values = args.linear_heads
    return Qwen3_5TextConfig(
        **common,
        layer_types=layer_types,
        linear_num_key_heads=keys,
        linear_num_value_heads=values,
        linear_key_head_dim=args.linear_head_dim,
        linear_value_head_dim=args.linear_head_dim,
    )


class Breakdown:
    """Forward and backward milliseconds and saved bytes of each of `PARTS` (summed over layers), by module hooks:
    a module's backward runs from its output's gradient to its input's (autograd runs one node at a time on CPU)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.forward_ms: dict[str, float] = defaultdict(float)
        self.backward_ms: dict[str, float] = defaultdict(float)
        self.saved: dict[str, dict[int, int]] = defaultdict(dict)
        self.current = "other"
        self.handles = []
        for name, module in model.named_modules():
            part = name.rpartition(".")[2]
            if part in PARTS:
                self.handles.append(module.register_forward_pre_hook(self._enter(part), with_kwargs=True))
                self.handles.append(module.register_forward_hook(self._leave(part), with_kwargs=True))

    def _enter(self, part: str):
        def hook(module, args, kwargs):
            self.current, module._bench_start = part, now()
            x = kwargs.get("hidden_states", args[0] if args else None)
            if torch.is_tensor(x) and x.requires_grad:
                x.register_hook(lambda _grad: self._backward_end(module, part))

        return hook

    def _leave(self, part: str):
        def hook(module, args, kwargs, output):
            self.forward_ms[part] += (now() - module._bench_start) * 1e3
            self.current = "other"
            y = output[0] if isinstance(output, tuple) else output
            if torch.is_tensor(y) and y.requires_grad:
                y.register_hook(lambda _grad: setattr(module, "_bench_backward", now()))

        return hook

    def _backward_end(self, module, part: str) -> None:
        self.backward_ms[part] += (now() - module._bench_backward) * 1e3

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.saved[self.current][storage.data_ptr()] = storage.nbytes()
        return tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def close(self) -> dict:
        for handle in self.handles:
            handle.remove()
        saved = {part: sum(storages.values()) for part, storages in self.saved.items()}
        return {"forward_ms": dict(self.forward_ms), "backward_ms": dict(self.backward_ms), "saved": saved}


def saved_bytes_hooks(model: torch.nn.Module, storages: dict[int, int]):
    """Record the storages autograd saves (parameters excluded) into `storages`, each once."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)


def configuration(_rank: int, world: int, kind: str, length: int, measure: str, args: argparse.Namespace) -> dict:
    """One (model, tokens, cp=world) configuration on this rank, every rank's figures: `measure` "time" (step times,
    the breakdown) or "memory" (peak RSS rise and saved bytes of the step after a warm-up)."""
    quiet_transformers()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecations, not ours to fix here
    torch.manual_seed(args.seed)
    config = model_config(args, kind, max(args.lengths))
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().train()
    if world > 1:
        import optimum_parallel as op

        mesh = op.init_mesh(cp=world, timeout=900, train_timeout=900)
        model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(model)
        model, _ = op.parallelize(model, None, mesh, {"dp_config": {"sharding_level": 0}})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = random_batch(args.vocab, 1, length, args.seed)
    rss, peaks, saved, losses = [], [], [], []
    pending = []  # the previous step's optimizer update, run untimed before the next

    def before() -> None:
        if pending:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            pending.clear()
        gc.collect()
        if world > 1:
            dist.barrier()
        Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := VmRSS
        rss.append(proc_status_bytes("VmRSS"))

    def step() -> None:
        storages: dict[int, int] = {}
        with saved_bytes_hooks(model, storages):
            loss = model(**batch).loss
        loss.backward()
        peaks.append(proc_status_bytes("VmHWM") - rss[-1])
        saved.append(sum(storages.values()))
        losses.append(loss.item())
        pending.append(True)

    timed = args.steps if measure == "time" else 1
    times = timed_steps(step, timed=timed, warmup=1, before=before, across_ranks=world > 1)
    result = {"ms": times.median * 1e3, "times_ms": [t * 1e3 for t in times], "loss": losses[0]}
    result.update(peak=peaks[-1], rss_rises=peaks, saved=max(saved), rss_before=rss[-1])
    if measure == "time" and args.breakdown == length:
        before()
        watch = Breakdown(model)
        start = now()
        with watch.hooks():
            loss = model(**batch).loss
        forward = now() - start
        loss.backward()
        result["breakdown"] = {**watch.close(), "step_ms": (now() - start) * 1e3}
        result["breakdown"]["forward_total_ms"] = forward * 1e3
    if world == 1:
        return {"ranks": [result]}
    ranks: list[dict | None] = [None] * world
    dist.all_gather_object(ranks, result)
    return {"ranks": ranks}


def run(kind: str, length: int, cp: int, args: argparse.Namespace) -> dict:
    """One configuration: its time in fresh processes, then its memory in others; {"error": why} where one failed or
    ran past --deadline."""
    what = f"{kind} {length} tokens cp={cp}"
    figures = {}
    for measure in ("time", "memory"):
        os.environ.update(MALLOC_ENV[measure])  # read by glibc when each spawned process starts
        try:
            fn_args = (kind, length, measure, args)
            figures[measure] = run_on_ranks(cp, configuration, fn_args, args.deadline, f"{what} ({measure})")["ranks"]
        except (RuntimeError, TimeoutError) as error:
            print(f"  {what}: did not run: {str(error).splitlines()[0]}", flush=True)
            return {"error": str(error)}
    ranks, memory = figures["time"], figures["memory"]
    out = {
        "ms": ranks[0]["ms"],  # already the slowest rank's, step by step
        "times_ms": ranks[0]["times_ms"],
        "peak": max(r["peak"] for r in memory),
        "saved": max(r["saved"] for r in memory),
        "loss": ranks[0]["loss"],
        "ranks": ranks,
        "memory_ranks": memory,
    }
    print(
        f"  {what}: {out['ms']:8.0f} ms  peak +{out['peak'] / MIB:7.0f} MiB  "
        f"saved {out['saved'] / MIB:7.0f} MiB  loss {out['loss']:.5f}",
        flush=True,
    )
    return out


def print_breakdown(results: dict, length: int, args: argparse.Namespace) -> None:
    print(f"\nWhere the step goes at {length} tokens (rank 0, one extra step with module hooks, summed over layers)\n")
    header = ("model", "cp", "part", "forward ms", "backward ms", "saved MiB")
    rows = []
    for kind in args.models:
        for cp in (1, 2):
            if "error" in results[kind][length][cp]:
                continue
            b = results[kind][length][cp]["ranks"][0]["breakdown"]
            parts = [p for p in PARTS if p in b["forward_ms"]]
            for part in parts:
                forward, backward = b["forward_ms"][part], b["backward_ms"].get(part, 0)
                saved = b["saved"].get(part, 0) / MIB
                rows.append((kind, cp, part, f"{forward:.0f}", f"{backward:.0f}", f"{saved:.0f}"))
            fwd_other = b["forward_total_ms"] - sum(b["forward_ms"][p] for p in parts)
            bwd_other = b["step_ms"] - b["forward_total_ms"] - sum(b["backward_ms"].get(p, 0) for p in parts)
            saved = b["saved"].get("other", 0) / MIB
            rows.append((kind, cp, "other", f"{fwd_other:.0f}", f"{bwd_other:.0f}", f"{saved:.0f}"))
    print_table(header, rows, align_numbers=True, title=f"where the step goes at {length} tokens")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet_transformers()
    os.environ["OMP_NUM_THREADS"] = "1"  # every spawned process: cp=1 uses one core, cp=2 two
    if any(length % 4 for length in args.lengths):
        raise SystemExit("--lengths must be multiples of 4 (cp=2 cuts the sequence into 4 chunks)")
    results: dict = {kind: {length: {} for length in args.lengths} for kind in args.models}
    for length in args.lengths:
        for kind in args.models:
            for cp in (1, 2):
                results[kind][length][cp] = run(kind, length, cp, args)

    keys, values = args.linear_heads
    print(
        f"\nhidden {args.hidden}, {args.layers} layers, {args.heads} attention heads, MLP {args.intermediate}, vocab "
        f"{args.vocab}, batch 1, fp32, sdpa; hybrid: qwen3_5_text, layers 3 linear_attention : 1 full_attention, "
        f"delta net {keys} key x {values} value heads of {args.linear_head_dim}.\n"
        f"OMP_NUM_THREADS=1 in every process: cp=1 is one process on one core (plain transformers), cp=2 two "
        f"processes on two cores (optimum-parallel). Step: forward + backward, median of {args.steps} after 1, the "
        f"slowest rank's; glibc's mmap threshold 256 MiB. Peak: RSS rise during the step after a warm-up, in other "
        f"processes with MALLOC_MMAP_THRESHOLD_=65536, the larger rank's. Saved: bytes autograd keeps for the "
        f"backward. Load average (1 min) at the end: {os.getloadavg()[0]:.2f}.\n"
    )
    header = ["tokens"]
    for kind in args.models:
        header += [f"{kind} ms cp=1", f"{kind} ms cp=2", f"{kind} x", f"{kind} peak MiB cp=1"]
        header += [f"{kind} peak MiB cp=2", f"{kind} peak x", f"{kind} saved x"]  # unique: each a metric of its own
    rows, verdicts = [], []
    for length in args.lengths:
        row: list[object] = [length]
        for kind in args.models:
            one, two = results[kind][length][1], results[kind][length][2]
            if "error" in one or "error" in two:
                row += ["-" if "error" in one else f"{one['ms']:.0f}", "-" if "error" in two else f"{two['ms']:.0f}"]
                row += ["-", "-" if "error" in one else f"{one['peak'] / MIB:.0f}"]
                row += ["-" if "error" in two else f"{two['peak'] / MIB:.0f}", "-", "-"]
                verdicts.append((kind, length, None, None, None))
                continue
            speed, memory = two["ms"] / one["ms"], two["peak"] / one["peak"]
            row += [f"{one['ms']:.0f}", f"{two['ms']:.0f}", f"{speed:.2f}"]
            row += [f"{one['peak'] / MIB:.0f}", f"{two['peak'] / MIB:.0f}", f"{memory:.2f}"]
            row.append(f"{two['saved'] / one['saved']:.2f}")
            verdicts.append((kind, length, speed, memory, abs(one["loss"] - two["loss"])))
        rows.append(row)
    print_table(header, rows, align_numbers=True, title="step time and peak activations, cp=2 vs cp=1")
    print()
    for kind, length, speed, memory, loss_diff in verdicts:
        if speed is None:
            print(f"{kind:6} {length:6}: did not run within --deadline {args.deadline:.0f} s (or failed): see above")
            continue
        ok_time, ok_memory = speed <= GOALS["time"], memory <= GOALS["memory"]
        print(
            f"{kind:6} {length:6}: time {speed:.2f}x ({'PASS' if ok_time else 'FAIL'} <= {GOALS['time']}), "
            f"peak activations {memory:.2f}x ({'PASS' if ok_memory else 'FAIL'} <= {GOALS['memory']}), "
            f"|loss cp=2 - cp=1| {loss_diff:.1e}"
        )
    if args.breakdown in args.lengths:
        print_breakdown(results, args.breakdown, args)
    if args.raw_json:
        args.raw_json.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        args.raw_json.write_text(json.dumps({"settings": settings, "results": results}, indent=1))
        print(f"\nwrote {args.raw_json}")


if __name__ == "__main__":
    main()
