"""`plan_report`: what a family's plan does to a model at a given tp, without processes or weights.

The model is built on the meta device from its config alone; the family's plan is resolved and
checked against a simulated mesh, and every split parameter's layout is computed for each rank from
the styles (the same `split_units` / `param_layouts` the styles use when they run). The report is a
table of parameter -> style and split, and the parameter bytes each rank holds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .manager import ParallelizersManager
from .plan import check_plan
from .styles import ColWiseParallel, ParallelStyle, RowWiseParallel
from .tensor_parallel.layout import ShardLayout, replicated, split_units


@dataclass
class SimulatedMesh:
    """Stands in for a ParallelMesh where only sizes matter (plans and checks), on one process."""

    tp_size: int
    tp_rank: int = 0
    sizes: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sizes = {"dp": 1, "pp": 1, "tp": self.tp_size, **self.sizes}

    def size(self, dim: str) -> int:
        return self.sizes["tp" if dim == "mp" else dim]

    def rank(self, dim: str) -> int:
        return self.tp_rank if dim in ("tp", "mp") else 0


def style_layouts(style: ParallelStyle, module: nn.Module, rank: int, world: int) -> dict[str, ShardLayout]:
    """{parameter name within `module`: layout on `rank`} for the parameters `style` splits (none for hooks)."""
    if hasattr(style, "param_layouts"):
        return style.param_layouts(module, rank, world)
    layouts = {}
    if isinstance(style, ColWiseParallel):
        layouts["weight"] = split_units(tuple(module.weight.shape), 0, rank, world, style.units)
        if module.bias is not None:
            layouts["bias"] = split_units(tuple(module.bias.shape), 0, rank, world, style.units)
    elif isinstance(style, RowWiseParallel):
        if isinstance(module, nn.Embedding):
            layouts["weight"] = split_units(tuple(module.weight.shape), 0, rank, world)
        else:
            layouts["weight"] = split_units(tuple(module.weight.shape), 1, rank, world, style.units)
            if module.bias is not None:
                layouts["bias"] = replicated(module.bias.shape)
    return layouts


def _load_config(model_dir_or_config):
    if isinstance(model_dir_or_config, (str, Path)):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_dir_or_config)
    return model_dir_or_config


def build_meta_model(config) -> nn.Module:
    """The model of `config` on the meta device: its first `architectures` entry (saved checkpoints have
    one), else the first of causal LM, seq2seq LM, masked LM or base model that the config supports."""
    import transformers

    candidates = [getattr(transformers, name, None) for name in (getattr(config, "architectures", None) or [])]
    with torch.device("meta"):
        for cls in candidates:
            if cls is not None:
                return cls._from_config(config)
        autos = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM")
        for auto in autos:
            try:
                return getattr(transformers, auto).from_config(config)
            except ValueError:
                continue
        return transformers.AutoModel.from_config(config)


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


def _style_name(style: ParallelStyle) -> str:
    """The style with the arguments that differ from its defaults: `ColWiseParallel(units=8)`."""
    try:
        defaults = vars(type(style)())
    except TypeError:  # a style with required arguments
        defaults = {}
    shown = {k: v for k, v in vars(style).items() if k not in defaults or defaults[k] != v}
    shown = {k: v for k, v in shown.items() if not callable(v)}
    return type(style).__name__ + (f"({', '.join(f'{k}={v}' for k, v in shown.items())})" if shown else "")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    line = lambda row: "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()  # noqa: E731
    return [line(header), "  ".join("-" * w for w in widths), *(line(row) for row in rows)]


@dataclass
class SimulatedPlan:
    """A family's plan resolved for every rank of a simulated tp group."""

    model: nn.Module  # on the meta device, untouched
    parallelizer: type
    tp: int
    layouts: list[dict[str, ShardLayout]]  # per rank: full parameter name -> layout (tied names included)
    styles: dict[str, list[str]]  # full parameter name -> the styles that act on it


def simulate_plan(model_dir_or_config, tp: int, parallelize_embeddings: bool = True) -> SimulatedPlan:
    """Build the model on meta, pick its parallelizer, check and resolve its plan for each of `tp` ranks."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp={tp!r} is not allowed; the tensor-parallel size must be a positive integer")
    model = build_meta_model(_load_config(model_dir_or_config))
    parallelizer = ParallelizersManager.parallelizer_for_model(model)
    mesh = SimulatedMesh(tp)
    parallelizer.check(model, mesh)
    targets = check_plan(model, parallelizer.plan(model, mesh, parallelize_embeddings, False), mesh)

    layouts: list[dict[str, ShardLayout]] = [{} for _ in range(tp)]
    styles_of: dict[str, list[str]] = {}
    for name, styles in targets.items():
        module = model.get_submodule(name)
        prefix = f"{name}." if name else ""
        for style in styles:
            per_rank = [style_layouts(style, module, rank, tp) for rank in range(tp)]
            touched = set(per_rank[0]) or {n for n, _ in module.named_parameters(recurse=False)}
            for param_name in touched:
                styles_of.setdefault(prefix + param_name, []).append(_style_name(style))
            for rank, split in enumerate(per_rank):
                layouts[rank].update({prefix + param_name: layout for param_name, layout in split.items()})
    return SimulatedPlan(model, parallelizer, tp, layouts, styles_of)


def plan_report(
    model_dir_or_config, tp: int, parallelize_embeddings: bool = True, dtype: torch.dtype | str | None = None
) -> str:
    """A table of which parameters the family's plan splits how at tensor-parallel size `tp`, and the
    parameter bytes per rank. Reads only the config (no weights); needs no process group."""
    config = _load_config(model_dir_or_config)
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
        numel = 0
        for name, param in params.items():
            layout = layouts[rank].get(name)
            numel += param.numel() if layout is None or layout.dim is None else _numel(layout.local_shape)
        per_rank.append(numel)
    total = sum(p.numel() for p in params.values())
    dtype = _dtype(config, dtype)
    element = torch.empty((), dtype=dtype).element_size()

    lines = [
        f"{type(model).__name__} ({config.model_type}), tp={tp}, parallelizer {sim.parallelizer.__name__}, "
        f"{dtype}: {total:,} parameters ({_human(total * element)}) on one device",
        "",
    ]
    lines += _table(["parameter", "style", "split (rank 0)", "global shape", "rank 0 shape", "count"], table_rows)
    lines += [""]
    rank_rows = [[str(r), f"{n:,}", _human(n * element), f"{n / total:.1%}"] for r, n in enumerate(per_rank)]
    lines += _table(["rank", "parameters", "bytes", "of one device"], rank_rows)
    return "\n".join(lines) + "\n"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
