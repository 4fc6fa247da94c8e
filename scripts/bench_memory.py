"""Benchmark per-rank memory on CPU/gloo: activation memory with sequence parallelism off and on (tp=2), against
Korthikanti et al. 2022, and parameter / gradient / optimizer-state memory per data-parallel sharding level.

What it measures
    1. Activation memory. For one forward of a randomly initialised fp32 Llama (no hub access), the bytes of the
       tensors autograd saves for backward, per rank, for: one process (tp=1), tp=2 without sequence parallelism
       and tp=2 with it; with eager attention (the a*s*s scores are materialised, as in the paper) and with sdpa.
       The bytes of one decoder layer are printed next to the formula of Korthikanti et al. 2022 ("Reducing
       Activation Recomputation in Large Transformer Models", section 4), per layer:
           no parallelism        s*b*h * (34 + 5as/h)            bytes at 16 bits
           tp=t, no SP           s*b*h * (10 + 24/t + 5as/(ht))
           tp=t, SP              s*b*h * (34/t + 5as/(ht))
       (the issue quotes the first line for "SP off"; at tp=t the paper's SP-off line is the second one),
       scaled x2 for fp32, and next to the same counting done for this Llama ("Llama count", see below).
       A second table splits each layer into its s*b*h term and its score term (5as/h) in bytes per s*b*h, a
       third shows where the bytes of one layer are saved (by module), and every row also gives the whole-model
       total (embedding, head and loss included) and the growth of the process peak RSS (VmHWM) during the step.
    2. Sharding levels at dp=2 x tp=2 (4 processes): per rank, the bytes of parameters (between steps and while
       held from forward to backward), gradients (after backward), AdamW state (after one step) for
       sharding_level 0 (DDP), 1 (ZeRO-1), 2 (FSDP2, no reshard after forward), 3 (FSDP2, reshard after forward),
       and their ratio to level 0.

How it measures
    Saved tensors are seen through `torch.autograd.graph.saved_tensors_hooks`; each storage is counted once
    (`untyped_storage().data_ptr()`, its full `nbytes()`), parameters (and views of them) are skipped, and
    forward pre/post hooks on every module say which decoder layer (and which module in it) saved the tensor
    first. Tensors of shape [b, heads, s, s] are the score term. DTensors (FSDP2) are counted by `.to_local()`.
    This is the memory autograd keeps alive until backward, which is what the paper counts; transient buffers
    and the allocator's slack are not in it (the peak RSS column shows the process-level picture, on 1 thread).

Why the measurement and the paper differ (the paper's 34 is for GPT at 16 bits)
    - fp32 here: every activation is 4 bytes (the formula column is x2; the paper's dropout masks are 1 byte);
    - no dropout in Llama: the paper's 2 masks of s*b*h bytes and the a*s*s*b mask and dropout output are absent,
      so the score term is 4as/h bytes per s*b*h at fp32 (softmax output only) instead of 2 x 5as/h;
    - RMSNorm as HF writes it keeps its input *and* its normalised input (2 tensors, not 1 per norm);
    - SwiGLU instead of GeLU(4h): three matrices with intermediate i (default 11008/4096 x h = 2.69h); the MLP keeps
      SiLU's input, SiLU's output, up_proj's output and down_proj's input: 4i instead of the paper's 2 x 4h;
    - sdpa keeps q, k, v, its output (o_proj's input, the same storage) and a log-sum-exp of b*a*s instead of the
      a*s*s scores; the paper's formula (which assumes materialised scores) is printed for sdpa rows too.
    "Llama count" is the paper's counting applied to this model (bytes per s*b*h at fp32, g = kv heads / heads):
        replicated under tp without SP: 4 x (2 norms x 2 tensors) + 4 (q/k/v input) + 4 (gate/up input) = 24
        split over tp:                  4 x (1 + 2g) (q, k, v) + 4 (o_proj input) + 4 x 4i/h (MLP inside)
        scores:                         eager 4as/h (softmax output); sdpa 4a/h (log-sum-exp of b*a*s)
    With SP, the Llama count (like the paper) divides everything by t. Megatron gets there by keeping only the
    local sequence slice of the all-gathered input of the q/k/v and gate/up projections and all-gathering it
    again in backward. A column-parallel layer that saves its all-gathered input keeps those two inputs whole:
    2 x 4(1 - 1/t) bytes per s*b*h per layer above the ideal (4 at t=2); the per-module table (rows q_proj and
    gate_proj) shows which of the two an implementation does.

How to run
    python scripts/bench_memory.py                         # full size, 1.5-2.5 minutes on 2 cores
    python scripts/bench_memory.py --layers 2 --seq 128    # smaller
    python scripts/bench_memory.py --parts sharding --levels 0 3

The script starts its own worker processes (torch.multiprocessing spawn, gloo on a free 127.0.0.1 port, one
thread each, 120 s process-group timeout): 1 for the tp=1 activation run, 2 for tp=2, 4 for the sharding
levels; the parent prints everything. Workers start with MALLOC_MMAP_THRESHOLD_=65536, so glibc maps and unmaps
every block of 64 KiB or more and the peak RSS follows the live tensors rather than the allocator's cache.
Memory numbers do not depend on timing, so a busy machine changes only how long it takes.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import transformers
from _common import (
    Batch,
    add_llama_args,
    add_run_args,
    build_llama,
    llama_config,
    local_tensor,
    print_table,
    proc_status_bytes,
    quiet_transformers,
    random_batch,
    tensor_bytes,
)
from _ranks import run_on_ranks
from torch import nn
from transformers import LlamaConfig

from optimum_parallel.memory_planner.activations import Dims, llama_layer_terms, paper_layer_terms

PG_TIMEOUT_S = 120
TP = 2
DP = 2
FP32 = 4  # bytes per element: the models here are fp32 (the paper counts 16-bit activations: its formula x2)
MIB = 2**20
ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
LOSS_SITE = "(LlamaForCausalLM.forward: loss)"
SITE_NOTES = {  # what the first saver keeps, for the per-module table
    "input_layernorm": "input, normalised input",
    "post_attention_layernorm": "input, normalised input",
    "self_attn.q_proj": "q/k/v input",
    "self_attn": "q, k, v; eager: softmax out; sdpa: out, lse; layer 0: RoPE cos/sin",
    "self_attn.o_proj": "o_proj input; sdpa: = sdpa out, counted above",
    "mlp.gate_proj": "gate/up input",
    "mlp.act_fn": "SiLU input",
    "mlp": "SiLU output, up output",
    "mlp.down_proj": "down_proj input",
    "model.norm": "input, normalised input",
    "lm_head": "lm_head input",
    LOSS_SITE: "log-softmax / vocab-parallel softmax",
}
MMAP_THRESHOLD_ENV, MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_", 64 * 1024  # glibc: mmap (and unmap) large blocks


# --------------------------------------------------------------------------------------------------------------
# Arguments, model, batch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2, help="rows (activation part)")
    add_llama_args(parser, seq=512, seq_help="sequence length (activation part)")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    parser.add_argument("--attn", nargs="+", choices=ATTN_IMPLEMENTATIONS, default=list(ATTN_IMPLEMENTATIONS))
    parser.add_argument("--dp-batch", type=int, default=2, help="rows per dp rank (sharding part)")
    parser.add_argument("--dp-seq", type=int, default=128, help="sequence length (sharding part)")
    parser.add_argument("--levels", nargs="+", type=int, choices=(0, 1, 2, 3), default=[0, 1, 2, 3])
    parser.add_argument("--parts", nargs="+", choices=("activations", "sharding"), default=["activations", "sharding"])
    add_run_args(parser, deadline=900, deadline_help="seconds before a worker group is killed")
    return parser.parse_args(argv)


def model_config(args: argparse.Namespace) -> LlamaConfig:
    return llama_config(args, longest=max(args.seq, args.dp_seq))


def build_model(args: argparse.Namespace, attn: str) -> nn.Module:
    return build_llama(args, attn, model_config(args))


def make_batch(args: argparse.Namespace, rows: int, seq: int, seed_offset: int = 0) -> Batch:
    return random_batch(args.vocab, rows, seq, args.seed + seed_offset)


def parallelize_tp(model: nn.Module, sequence_parallel: bool) -> nn.Module:
    import optimum_parallel as op

    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    return parallelizer.parallelize(model, sequence_parallel_enabled=sequence_parallel)


# --------------------------------------------------------------------------------------------------------------
# Measuring: saved tensors, tensor bytes, RSS


def reset_peak_rss() -> int:
    """Reset VmHWM to the current RSS (Linux >= 4.0) and return the current RSS in bytes (0 where unsupported)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return proc_status_bytes("VmRSS")
    except OSError:
        return 0


def peak_rss_growth(start: int) -> int | None:
    """Growth of the peak RSS since `reset_peak_rss` returned `start`, or None where it cannot be measured."""
    return proc_status_bytes("VmHWM") - start if start else None


@dataclass
class SavedBytes:
    """Bytes saved for backward during one forward, attributed to the module that saved each storage first."""

    layers: int
    seq: int
    by_layer: list[int] = field(default_factory=list)
    scores_by_layer: list[int] = field(default_factory=list)  # the [b, heads, s, s] tensors among them
    layer_sites: dict[str, int] = field(default_factory=dict)  # summed over layers
    outside_sites: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_layer = [0] * self.layers
        self.scores_by_layer = [0] * self.layers

    @property
    def per_layer(self) -> float:
        return sum(self.by_layer) / self.layers

    @property
    def scores_per_layer(self) -> float:
        return sum(self.scores_by_layer) / self.layers

    @property
    def total(self) -> int:
        return sum(self.by_layer) + sum(self.outside_sites.values())

    def add(self, t: torch.Tensor, nbytes: int, where: tuple[int | None, str]) -> None:
        layer, site = where
        if layer is None:
            self.outside_sites[site] = self.outside_sites.get(site, 0) + nbytes
            return
        self.by_layer[layer] += nbytes
        self.layer_sites[site] = self.layer_sites.get(site, 0) + nbytes
        if t.dim() == 4 and tuple(t.shape[-2:]) == (self.seq, self.seq):
            self.scores_by_layer[layer] += nbytes


def _decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            return name, module
    raise ValueError(f"{type(model).__name__} has no list of decoder layers")


@contextmanager
def count_saved_tensors(model: nn.Module, seq: int) -> Iterator[SavedBytes]:
    """Count the bytes autograd saves for backward inside the block, per decoder layer and per module."""
    prefix, layers = _decoder_layers(model)
    result = SavedBytes(layers=len(layers), seq=seq)
    parameters = {local_tensor(p).untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    stack: list[tuple[int | None, str]] = [(None, LOSS_SITE)]

    def where(name: str) -> tuple[int | None, str]:
        if name.startswith(prefix + "."):
            index, _, site = name[len(prefix) + 1 :].partition(".")
            return int(index), site or "(layer itself: residual adds)"
        return None, name or LOSS_SITE

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = local_tensor(t).untyped_storage()
        ptr = storage.data_ptr()
        if storage.nbytes() and ptr not in parameters and ptr not in seen:
            seen.add(ptr)
            result.add(t, storage.nbytes(), stack[-1])
        return t

    def enter(site: tuple[int | None, str]) -> Callable[..., None]:
        return lambda *_: stack.append(site)  # list.append returns None: the inputs are left as they are

    def leave(*_: object) -> None:
        stack.pop()

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(where(name)), prepend=True))
        handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield result
    finally:
        for handle in handles:
            handle.remove()


# --------------------------------------------------------------------------------------------------------------
# Part 1: activation memory


@dataclass
class ActivationResult:
    attn: str
    tp: int
    sequence_parallel: bool
    saved: SavedBytes
    peak_rss: int | None
    loss: float


def measure_activations(model: nn.Module, batch: Batch, attn: str, tp: int, sp: bool) -> ActivationResult:
    """A warm-up step, then one forward (saved tensors counted) and backward; the peak RSS growth covers both
    (gradients included: they are freed before the measured step)."""
    model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    gc.collect()
    start = reset_peak_rss()
    with count_saved_tensors(model, seq=batch["input_ids"].shape[1]) as saved:
        loss = model(**batch).loss
    loss.backward()
    peak = peak_rss_growth(start)
    model.zero_grad(set_to_none=True)
    return ActivationResult(attn, tp, sp, saved, peak, loss.item())


def worst_rank(result: object, key: Callable[[object], float]) -> object:
    """The result of the rank with the largest `key` (all ranks take part)."""
    results: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    return max(results, key=key)


def activations_single_task(args: argparse.Namespace) -> list[ActivationResult]:
    """tp=1: the plain transformers model in one process."""
    batch = make_batch(args, args.batch, args.seq)
    return [measure_activations(build_model(args, attn), batch, attn, 1, False) for attn in args.attn]


def activations_task(args: argparse.Namespace) -> list[ActivationResult]:
    """On each of the tp=2 ranks: SP off and on, for every attention implementation; the worst rank's numbers."""
    batch = make_batch(args, args.batch, args.seq)
    results = []
    for attn in args.attn:
        for sp in (False, True):
            model = parallelize_tp(build_model(args, attn), sp)
            result = measure_activations(model, batch, attn, TP, sp)
            results.append(worst_rank(result, key=lambda r: r.saved.total))
            del model
            gc.collect()
            dist.barrier()
    return results


# --------------------------------------------------------------------------------------------------------------
# Part 2: sharding levels


@dataclass
class ShardingResult:
    level: int
    params: int  # between steps
    params_in_step: int  # registered parameters after forward, before backward
    grads: int
    optim_state: int
    peak_rss: int | None
    loss: float

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optim_state


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[object]:
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps this rank's optimizer there
    return [value for state in inner.state.values() for value in state.values()]


def sharding_step(args: argparse.Namespace, level: int) -> ShardingResult:
    """Build, parallelize (tp, then dp at `level`), and measure one forward + backward + AdamW step on this rank."""
    import optimum_parallel as op
    from optimum_parallel.data_parallel.levels import DataParallelConfig, apply_data_parallel

    mesh = op.get_mesh()
    model = build_model(args, "sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model)
    optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
    model, optimizer = apply_data_parallel(model, optimizer, mesh, DataParallelConfig(sharding_level=level))
    batch = make_batch(args, args.dp_batch, args.dp_seq, seed_offset=mesh.rank("dp"))

    gc.collect()
    dist.barrier()
    start = reset_peak_rss()
    loss = model(**batch).loss
    params_in_step = tensor_bytes(model.parameters())
    loss.backward()
    grads = tensor_bytes(p.grad for p in model.parameters())
    optimizer.step()
    peak = peak_rss_growth(start)
    result = ShardingResult(
        level=level,
        params=tensor_bytes(model.parameters()),
        params_in_step=params_in_step,
        grads=grads,
        optim_state=tensor_bytes(optimizer_state(optimizer)),
        peak_rss=peak,
        loss=loss.item(),
    )
    optimizer.zero_grad(set_to_none=True)
    return result


def sharding_task(args: argparse.Namespace) -> list[ShardingResult]:
    results = []
    for level in args.levels:
        results.append(worst_rank(sharding_step(args, level), key=lambda r: r.total))
        gc.collect()
        dist.barrier()
    return results


# --------------------------------------------------------------------------------------------------------------
# Processes


TASKS: dict[str, Callable[[argparse.Namespace], list]] = {
    "activations tp=1": activations_single_task,
    "activations": activations_task,
    "sharding": sharding_task,
}


def rank_main(rank: int, world: int, dp: int, task: str, args: argparse.Namespace) -> list:
    """One rank of a dp x tp mesh: run `task` (rank 0's result is the one reported)."""
    import optimum_parallel as op

    quiet_transformers()
    op.init_mesh(dp=dp, tp=world // dp, timeout=PG_TIMEOUT_S)
    return TASKS[task](args)


def launch(task: str, world: int, dp: int, args: argparse.Namespace) -> list:
    """Run `task` on `world` spawned ranks (a dp x tp mesh) and return rank 0's result; raise if a rank fails."""
    os.environ[MMAP_THRESHOLD_ENV] = str(MMAP_THRESHOLD)  # freed buffers go back to the OS: RSS follows live memory
    return run_on_ranks(world, rank_main, (dp, task, args), args.deadline, task)


# --------------------------------------------------------------------------------------------------------------
# Formulas


def dims_of(args: argparse.Namespace) -> Dims:
    """The paper's symbols for the activation part's model and batch."""
    return Dims.from_config(model_config(args), s=args.seq, b=args.batch)


def paper_terms(d: Dims, tp: int, sp: bool) -> tuple[float, float]:
    """Korthikanti et al. 2022, bytes per s*b*h per layer scaled to fp32: (s*b*h term, 5as/h score term)."""
    return paper_layer_terms(d, tp, sp, FP32)


def llama_terms(d: Dims, tp: int, sp: bool, attn: str) -> tuple[float, float]:
    """The paper's counting for this Llama at fp32 (see the module docstring), bytes per s*b*h per layer. Under SP
    it divides everything by t, the q/k/v and gate/up inputs too (Megatron's ideal; the memory planner counts
    them whole, as this engine keeps them)."""
    return llama_layer_terms(d, tp, sp, FP32, attn, whole_inputs=False)


# --------------------------------------------------------------------------------------------------------------
# Report


def print_titled(title: str, header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """A markdown table under its title (`_common.print_table`: the first column left-aligned, the numbers
    right-aligned), recorded under that title for `scripts/bench.py memory --json`."""
    print(title)
    print_table(header, rows, align_numbers=True, title=title)
    print()


def mib(nbytes: float | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / MIB:.2f}"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def sp_label(r: ActivationResult) -> str:
    return "on" if r.sequence_parallel else ("-" if r.tp == 1 else "off")


def sp_off_of(results: list[ActivationResult], r: ActivationResult) -> ActivationResult | None:
    return next((o for o in results if o.attn == r.attn and o.tp == r.tp and not o.sequence_parallel), None)


def tp1_of(results: list[ActivationResult], r: ActivationResult) -> ActivationResult | None:
    return next((o for o in results if o.attn == r.attn and o.tp == 1), None)


def saving(on: float, off: float) -> str:
    """SP off / SP on, and the share of the SP-off bytes that SP saves."""
    return f"{off / on:.2f}x (saves {1 - on / off:.0%})"


def activation_rows(results: list[ActivationResult], d: Dims) -> list[tuple[str, ...]]:
    rows = []
    for r in results:
        paper = sum(paper_terms(d, r.tp, r.sequence_parallel)) * d.sbh
        llama = sum(llama_terms(d, r.tp, r.sequence_parallel, r.attn)) * d.sbh
        off = sp_off_of(results, r)
        off_paper = sum(paper_terms(d, r.tp, False)) * d.sbh
        measured_saving = saving(r.saved.per_layer, off.saved.per_layer) if r.sequence_parallel and off else "-"
        paper_saving = saving(paper, off_paper) if r.sequence_parallel else "-"
        rows.append(
            (
                r.attn,
                str(r.tp),
                sp_label(r),
                mib(r.saved.per_layer),
                mib(paper),
                f"{r.saved.per_layer / paper:.2f}",
                mib(llama),
                f"{r.saved.per_layer / llama:.2f}",
                measured_saving,
                paper_saving,
                mib(r.saved.total),
                mib(r.peak_rss),
            )
        )
    return rows


def term_rows(results: list[ActivationResult], d: Dims) -> list[tuple[str, ...]]:
    rows = []
    for r in results:
        linear = (r.saved.per_layer - r.saved.scores_per_layer) / d.sbh
        scores = r.saved.scores_per_layer / d.sbh
        paper_linear, paper_scores = paper_terms(d, r.tp, r.sequence_parallel)
        llama_linear, llama_scores = llama_terms(d, r.tp, r.sequence_parallel, r.attn)
        if r.attn != "eager":  # sdpa keeps no [b, a, s, s] tensor: its attention term sits in the s*b*h column
            llama_linear, llama_scores = llama_linear + llama_scores, 0.0
        base, off = tp1_of(results, r), sp_off_of(results, r)
        base_linear = (base.saved.per_layer - base.saved.scores_per_layer) if base else None
        off_linear = (off.saved.per_layer - off.saved.scores_per_layer) if off else None
        rows.append(
            (
                r.attn,
                str(r.tp),
                sp_label(r),
                f"{linear:.2f}",
                f"{llama_linear:.2f}",
                f"{paper_linear:.2f}",
                f"{scores:.2f}",
                f"{llama_scores:.2f}",
                f"{paper_scores:.2f}",
                ratio(off_linear, linear * d.sbh) if r.sequence_parallel and off_linear else "-",
                ratio(paper_terms(d, r.tp, False)[0], paper_linear) if r.sequence_parallel else "-",
                ratio(base_linear, linear * d.sbh) if base_linear and r.tp > 1 else "-",
                ratio(paper_terms(d, 1, False)[0], paper_linear) if r.tp > 1 else "-",
            )
        )
    return rows


def site_label(part: str, site: str) -> str:
    note = SITE_NOTES.get(site)
    return f"{part}: {site}" + (f" ({note})" if note else "")


def site_rows(results: list[ActivationResult], d: Dims) -> list[tuple[str, ...]]:
    layer_sites = list(dict.fromkeys(s for r in results for s in r.saved.layer_sites))
    outside_sites = list(dict.fromkeys(s for r in results for s in r.saved.outside_sites))
    rows = []
    for site in layer_sites:
        rows.append(
            (
                site_label("layer", site),
                *(f"{r.saved.layer_sites.get(site, 0) / r.saved.layers / d.sbh:.2f}" for r in results),
            )
        )
    rows.append(("layer: total", *(f"{r.saved.per_layer / d.sbh:.2f}" for r in results)))
    for site in outside_sites:
        rows.append(
            (site_label("whole model", site), *(f"{r.saved.outside_sites.get(site, 0) / d.sbh:.2f}" for r in results))
        )
    return rows


def print_activation_report(args: argparse.Namespace, results: list[ActivationResult]) -> None:
    d = dims_of(args)
    config = model_config(args)
    print(
        f"\nActivation memory per rank: Llama hidden {d.h}, intermediate {d.i}, {args.layers} layers, {d.a} heads "
        f"({config.num_key_value_heads} kv), vocab {args.vocab}, fp32; batch {d.b} x seq {d.s}; "
        f"s*b*h = {d.sbh} elements. Bytes saved for backward by one forward (worst rank), per decoder layer = mean "
        f"over layers."
    )
    print(
        "paper = Korthikanti et al. 2022 at fp32 (x2 of the 16-bit formula): tp=1 sbh(34+5as/h), "
        "tp=t SP off sbh(10+24/t+5as/(ht)), SP on sbh(34/t+5as/(ht)); Llama = the same counting for this model "
        "(module docstring).\n"
    )
    header = (
        "attn",
        "tp",
        "SP",
        "measured MiB/layer",
        "paper MiB/layer (fp32)",
        "measured/paper",
        "Llama count MiB/layer",
        "measured/Llama",
        "per-rank saving vs SP off: measured",
        "paper",
        "whole model MiB",
        "peak RSS growth MiB",
    )
    print_titled("Table 1: activation memory per decoder layer, per rank", header, activation_rows(results, d))
    header = (
        "attn",
        "tp",
        "SP",
        "sbh term: measured",
        "Llama",
        "paper",
        "score term: measured",
        "Llama",
        "paper",
        "sbh term SP off/on: measured",
        "paper",
        "sbh term tp=1/this: measured",
        "paper",
    )
    print_titled(
        "Table 2: the two terms, bytes per s*b*h per layer (score term = the [b, a, s, s] tensors; sdpa has none)",
        header,
        term_rows(results, d),
    )
    header = (
        "saved where (first saver)",
        *(f"{r.attn} tp={r.tp}" + f" SP {sp_label(r)}" * (r.tp > 1) for r in results),
    )
    print_titled(
        "Table 3: where the bytes are saved, bytes per s*b*h (layer rows: per layer)", header, site_rows(results, d)
    )
    losses = ", ".join(f"{r.attn} tp={r.tp} SP {sp_label(r)}: {r.loss:.5f}" for r in results)
    print(f"losses (the same model and batch everywhere): {losses}\n")


def print_sharding_report(args: argparse.Namespace, results: list[ShardingResult]) -> None:
    base = next((r for r in results if r.level == 0), None)
    names = {0: "DDP", 1: "ZeRO-1", 2: "FSDP2 (no reshard)", 3: "FSDP2 (reshard)"}
    print(
        f"Per-rank memory per sharding level, dp={DP} x tp={TP} (4 processes, worst rank), same model, sdpa, "
        f"{args.dp_batch} rows x seq {args.dp_seq} per dp rank, AdamW; MiB and ratio to level 0."
    )
    header = (
        "level",
        "data parallel",
        "params between steps",
        "params forward->backward",
        "grads after backward",
        "AdamW state after step",
        "params+grads+state",
        "peak RSS growth in step",
    )
    rows = []
    for r in results:
        cells = [
            (r.params, base.params if base else 0),
            (r.params_in_step, base.params_in_step if base else 0),
            (r.grads, base.grads if base else 0),
            (r.optim_state, base.optim_state if base else 0),
            (r.total, base.total if base else 0),
        ]
        rows.append(
            (
                str(r.level),
                names[r.level],
                *(f"{mib(v)} ({ratio(v, b)})" for v, b in cells),
                mib(r.peak_rss),
            )
        )
    print_titled("Table 4: per-rank memory per sharding level", header, rows)
    print(
        "notes: FSDP2 keeps only the shards between steps at level 2 too (it reshards after backward); level 2 "
        "differs from level 3 while a step runs: its parameters stay gathered from forward to backward, while level 3 "
        "frees them after each block's forward (the root's too: apply_data_parallel passes reshard_after_forward "
        "explicitly) and gathers them again in backward. ZeRO-1 splits the state by "
        "whole parameters, so its halves are only about even. DDP's gradient buckets (another copy of the "
        "gradients) and FSDP2's all-gather buffers are in the peak RSS column, not in the tensor columns."
    )
    losses = ", ".join(f"level {r.level}: {r.loss:.5f}" for r in results)
    print(f"first-step loss (rank with the most memory): {losses}\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet_transformers()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, gloo, {os.cpu_count()} CPUs",
        flush=True,
    )
    if "activations" in args.parts:
        print("activations: tp=1 on 1 process ...", file=sys.stderr, flush=True)
        results = launch("activations tp=1", 1, 1, args)
        print(f"activations: tp={TP} on {TP} processes ...", file=sys.stderr, flush=True)
        results += launch("activations", TP, 1, args)
        order = {attn: i for i, attn in enumerate(args.attn)}
        results.sort(key=lambda r: (order[r.attn], r.tp, r.sequence_parallel))
        print_activation_report(args, results)
    if "sharding" in args.parts:
        print(
            f"sharding levels {args.levels} on dp={DP} x tp={TP} = {DP * TP} processes ...", file=sys.stderr, flush=True
        )
        print_sharding_report(args, launch("sharding", DP * TP, DP, args))


if __name__ == "__main__":
    main()
