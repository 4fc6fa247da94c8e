"""`plan_report`: what a family's plan does to a model at a given tp, without processes or weights.

The model is built on the meta device from its config alone; the family's plan is resolved and
checked against a simulated mesh, and every split parameter's layout is computed for each rank from
the styles' own shard specs (the ones they split by when they run). The report is a
table of parameter -> style and split, and the parameter bytes each rank holds.
"""

from __future__ import annotations

import re

import torch

from ..tensor_parallel.spec import ShardLayout
from .simulate import load_config, simulate_plan
from .tables import human_bytes, numel, table


def _dtype(config, dtype: torch.dtype | str | None) -> torch.dtype:
    dtype = dtype or getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def _describe(layout: ShardLayout | None, note: str = "") -> str:
    if layout is None or layout.dim is None:
        return note or "replicated"
    size = layout.global_shape[layout.dim]
    if len(layout.ranges) > 1:
        text = f"dim {layout.dim}: {len(layout.ranges)} packed parts, each split"
    else:
        ((start, end),) = layout.ranges
        text = f"dim {layout.dim}: [{start}, {end}) of {size}"
    return text + (f", on {layout.replicas} ranks" if layout.replicas > 1 else "")


def plan_report(
    model_dir_or_config, tp: int, parallelize_embeddings: bool = True, dtype: torch.dtype | str | None = None
) -> str:
    """A table of which parameters the family's plan splits how at tensor-parallel size `tp`, and the
    parameter bytes per rank. Reads only the config (no weights); needs no process group."""
    config = load_config(model_dir_or_config)
    sim = simulate_plan(config, tp, parallelize_embeddings)
    model, layouts = sim.model, sim.layouts
    params = dict(model.named_parameters())  # tied parameters once, under their first name

    rows: dict[str, list[str]] = {}
    untouched = 0
    for name, param in model.named_parameters(remove_duplicate=False):  # tied names get their own rows
        if name not in sim.styles:
            untouched += 1
            continue
        layout = layouts[0].get(name)
        local = list(layout.local_shape) if layout is not None else list(param.shape)
        key = _pattern(name)
        if key in rows:
            rows[key][5] = str(int(rows[key][5]) + 1)
            continue
        styles = " + ".join(dict.fromkeys(sim.styles[name]))
        note = "replicated, gradient summed over tp" if "GradAllReduce" in styles else ""
        rows[key] = [key, styles, _describe(layout, note), str(list(param.shape)), str(local), "1"]
    table_rows = [*rows.values(), ["(all other parameters)", "-", "replicated", "", "", str(untouched)]]

    per_rank = []
    for rank in range(tp):
        count = 0
        for name, param in params.items():
            layout = layouts[rank].get(name)
            count += param.numel() if layout is None or layout.dim is None else numel(layout.local_shape)
        per_rank.append(count)
    total = sum(p.numel() for p in params.values())
    dtype = _dtype(config, dtype)
    element = torch.empty((), dtype=dtype).element_size()

    lines = [
        f"{type(model).__name__} ({config.model_type}), tp={tp}, parallelizer {sim.parallelizer.__name__}, "
        f"{dtype}: {total:,} parameters ({human_bytes(total * element)}) on one device",
        "",
    ]
    lines += table(["parameter", "style", "split (rank 0)", "global shape", "rank 0 shape", "count"], table_rows)
    lines += [""]
    rank_rows = [[str(r), f"{n:,}", human_bytes(n * element), f"{n / total:.1%}"] for r, n in enumerate(per_rank)]
    lines += table(["rank", "parameters", "bytes", "of one device"], rank_rows)
    return "\n".join(lines) + "\n"
