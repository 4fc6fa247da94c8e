"""Text of the memory planner: a table of one layout's estimate (SP off and on), and the list of suggestions."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from .tables import table
from .workload import GIB, MemoryEstimate, Workload

if TYPE_CHECKING:
    from .estimate import MemoryPlanner

UNITS = (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def pick_unit(largest: float) -> tuple[str, float]:
    """The largest binary unit in which `largest` bytes is at least 1 (GiB for real models, MiB for tiny ones)."""
    return next(((name, scale) for name, scale in UNITS if largest >= scale), UNITS[-1])


def in_unit(n: float | None, scale: float) -> str:
    return "-" if n is None else f"{n / scale:.2f}"


def _count(n: int) -> str:
    for suffix, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


def describe_model(planner: MemoryPlanner, workload: Workload) -> str:
    c = planner.config
    d = planner.dims(workload)
    master = " + fp32 master weights" if workload.uses_master_weights else ""
    return (
        f"{type(planner.model).__name__} ({c.model_type}): {_count(planner.num_parameters)} parameters, "
        f"{planner.num_layers} layers, hidden {d.h}, {d.a} heads ({round(d.g * d.a)} kv), vocab {d.v}; "
        f"{workload.dtype}{master}, seq {workload.seq_len} x micro-batch {workload.micro_batch}, "
        f"{workload.attention} attention"
    )


def _groups(layout) -> str:
    hybrid = layout.sharding_level >= 1 and layout.sharding_group < layout.data_parallel
    return f" in groups of {layout.sharding_group} (shard_size)" if hybrid else ""


def _ep(layout) -> str:
    return f" ep={layout.ep}" if layout.ep > 1 else ""


def format_estimate(planner: MemoryPlanner, off: MemoryEstimate, on: MemoryEstimate | None) -> str:
    """A table of one layout without (and with) sequence parallelism, bytes per rank in a readable unit."""
    layout = off.layout
    method = {"llama": "Llama count", "paper": "Korthikanti et al. 2022"}[off.activation_method]
    columns = [off] + ([on] if on is not None else [])
    unit, scale = pick_unit(max(e.total for e in columns))
    lines = [
        describe_model(planner, off.workload),
        f"layout: dp={layout.dp} tp={layout.tp} pp={layout.pp} cp={layout.cp}{_ep(layout)}, sharding level "
        f"{layout.sharding_level}"
        f"{_groups(layout)}; {unit} on the rank with the most",
        "",
    ]
    header = ["", "SP off"] + (["SP on"] if on is not None else [])
    rows = [
        ["parameters", *(in_unit(e.parameters, scale) for e in columns)],
        ["gradients", *(in_unit(e.gradients, scale) for e in columns)],
        ["optimizer state", *(in_unit(e.optimizer_state, scale) for e in columns)],
        ["buffers", *(in_unit(e.buffers, scale) for e in columns)],
        [f"activations ({method})", *(in_unit(e.activations, scale) for e in columns)],
        ["total", *(in_unit(e.total, scale) for e in columns)],
        ["", *("" for _ in columns)],
        ["activations, Korthikanti et al. 2022", *(in_unit(e.activations_paper, scale) for e in columns)],
    ]
    if off.activations_llama is not None:
        rows.append(["activations, Llama count", *(in_unit(e.activations_llama, scale) for e in columns)])
    if off.snapshot:
        rows.append(["async save snapshot (host memory)", *(in_unit(e.snapshot, scale) for e in columns)])
    lines += table(header, rows, align_numbers=True)
    notes = list(dict.fromkeys(n for e in columns for n in e.notes))
    if on is None and layout.tp > 1:
        why = planner.refusal(replace(layout, sequence_parallel=True), off.workload)
        notes.append(f"SP on is not shown: the engine refuses it ({why})")
    lines += ["", *(f"note: {n}" for n in notes)]
    return "\n".join(lines) + "\n"


def format_suggestions(
    planner: MemoryPlanner, estimates: list[MemoryEstimate], devices: int, memory_bytes: float, reserve: float, top: int
) -> str:
    workload = estimates[0].workload if estimates else None
    lines = [describe_model(planner, workload)] if workload else []
    budget = memory_bytes * (1 - reserve)
    lines.append(
        f"{len(estimates)} layouts fit {devices} devices of {memory_bytes / GIB:.1f} GiB "
        f"(budget {budget / GIB:.1f} GiB per device after a {reserve:.0%} reserve); best first: fewest tp, then "
        f"fewest pp, then fewest cp, then lowest sharding level, {'then fewest ep, ' if planner.experts.counts else ''}"
        "then most headroom"
    )
    if not estimates:
        return "\n".join(lines) + "\n"
    unit, scale = pick_unit(max(e.total for e in estimates[:top]))
    rows, moe = [], bool(planner.experts.counts)  # an ep column for mixture-of-experts models
    for rank, e in enumerate(estimates[:top], 1):
        sizes = (e.parameters, e.gradients, e.optimizer_state, e.buffers, e.activations, e.total)
        layout = (e.layout.dp, e.layout.tp, e.layout.pp, e.layout.cp, *((e.layout.ep,) if moe else ()))
        layout += (e.layout.sharding_level,)
        sp = "on" if e.layout.sequence_parallel else "off"
        free = f"{1 - e.total / memory_bytes:.0%}"
        rows.append([str(rank), *map(str, layout), sp, *(in_unit(n, scale) for n in sizes), free])
    header = [
        "#",
        "dp",
        "tp",
        "pp",
        "cp",
        *(["ep"] if moe else []),
        "level",
        "SP",
        "params",
        "grads",
        "optim",
        "buffers",
        "activ.",
    ]
    header += [f"total {unit}", "free"]
    lines += ["", *table(header, rows, align_numbers=True)]
    if len(estimates) > top:
        lines.append(f"... {len(estimates) - top} more (--top N shows more)")
    return "\n".join(lines) + "\n"
