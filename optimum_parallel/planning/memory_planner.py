"""Memory planner: per-rank bytes of parameters, gradients, optimizer state and activations for a dp x pp x tp
layout with a data-parallel sharding level, from a transformers config alone (a meta model, no weights).

Parameters: counted exactly from the family's plan resolved at the simulated tp (the same layouts the ranks get:
head splits, kv heads replicated when tp > kv heads, uneven vocabulary splits), per pipeline stage as the
pipeline splits the layers (first stage: embeddings, last: final norm and head; tied weights on both).
The rank with the most bytes is reported. Assumptions (the `notes` of every estimate say them too):

- AdamW. fp32: fp32 parameters, gradients, m and v (16 bytes per parameter). 16-bit with master weights
  (default): 16-bit parameters and gradients, fp32 master copy, m and v (2 + 2 + 12 bytes, ZeRO's K = 12);
  without master weights: m and v in the parameter dtype (torch's AdamW on 16-bit parameters, 8 bytes).
- Sharding levels over dp (peak of a step): 0 all replicated; 1 optimizer state / dp (ZeRO-1 splits by whole
  parameters, so only about evenly); 2 + gradients / dp (FSDP2 keeps parameters gathered from forward to
  backward); 3 + parameters / dp (plus the gathered working set of the current and the prefetched block).
- Buffers: DDP's gradient buckets or, under pp, the flattened gradients of the dp all-reduce (one more copy of
  the gradients, levels 0-1); FSDP2's gathered blocks and reduce-scatter input (levels 2-3).
- Activations per micro-batch, per decoder layer: Korthikanti et al. 2022 (GPT with dropout, 16-bit, scores
  materialised) sbh(34 + 5as/h) at tp=1, sbh(10 + 24/t + 5as/(ht)) at tp=t without sequence parallelism and
  sbh(34/t + 5as/(ht)) with it, scaled by the dtype, plus 4sbh(1 + v/h)/t outside the layers; and, for
  Llama-style decoders, the same counting done for this engine's Llama (`llama_layer_bytes`), which matches
  measurement (tests/test_memory_planner.py). Pipeline: under 1F1B stage s keeps pp - s micro-batches in
  flight (the first stage holds pp of them); under GPipe every stage keeps all of them.
Not counted: the runtime (CUDA context, NCCL), allocator fragmentation, temporary buffers of single ops:
`suggest_layouts` keeps a reserve of device memory for them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch
from torch import nn

from ..mesh import check_positive_int
from ..pipeline.split import stage_layers
from .simulate import build_meta_model, load_config, resolve_for_tp
from .tables import numel, table

GIB = 1024**3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float": "fp32"}
ATTENTION = ("sdpa", "eager")
ACTIVATION_METHODS = ("auto", "llama", "paper")
SCHEDULES = ("1f1b", "gpipe")
LLAMA_STYLE = ("llama", "mistral", "qwen2", "qwen3")  # RMSNorm, SwiGLU, no dropout: `llama_layer_bytes` applies


def parse_dtype(dtype: str | torch.dtype) -> str:
    """'fp32' | 'bf16' | 'fp16' from a name or a torch dtype; ValueError names the allowed values."""
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not allowed; allowed: {', '.join(DTYPES)}")
    return name


@dataclass(frozen=True)
class Layout:
    """One way to lay a model over dp x tp x pp devices."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    sharding_level: int = 0
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            check_positive_int(name, getattr(self, name), "a size")
        if self.sharding_level not in (0, 1, 2, 3) or isinstance(self.sharding_level, bool):
            raise ValueError(f"sharding_level={self.sharding_level!r} is not allowed; allowed: 0, 1, 2, 3")

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        sp = ", SP" if self.sequence_parallel else ""
        return f"dp={self.dp} tp={self.tp} pp={self.pp} level {self.sharding_level}{sp}"


@dataclass(frozen=True)
class Workload:
    """What one training step runs: tokens per micro-batch, precision, attention kernel."""

    seq_len: int = 2048
    micro_batch: int = 1
    num_microbatches: int | None = None  # pipeline micro-batches per step (default: pp)
    schedule: str = "1f1b"  # pipeline schedule: "1f1b" or "gpipe"
    dtype: str = "bf16"
    master_weights: bool | None = None  # default: True for 16-bit dtypes
    attention: str = "sdpa"
    activations: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        for name in ("seq_len", "micro_batch"):
            check_positive_int(name, getattr(self, name))
        if self.attention not in ATTENTION:
            raise ValueError(f"attention={self.attention!r} is not allowed; allowed: {', '.join(ATTENTION)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not allowed; allowed: {', '.join(SCHEDULES)}")
        if self.activations not in ACTIVATION_METHODS:
            raise ValueError(f"activations={self.activations!r}; allowed: {', '.join(ACTIVATION_METHODS)}")

    @property
    def element(self) -> int:
        return torch.empty((), dtype=DTYPES[self.dtype]).element_size()

    @property
    def uses_master_weights(self) -> bool:
        if self.dtype == "fp32":
            return False
        return True if self.master_weights is None else self.master_weights

    @property
    def optimizer_bytes_per_param(self) -> int:
        """AdamW state bytes per parameter: m and v (+ the fp32 master copy)."""
        return 12 if self.uses_master_weights else 2 * self.element


# --------------------------------------------------------------------------------------------------------------
# Activation formulas (bytes per micro-batch)


@dataclass(frozen=True)
class Dims:
    """The paper's symbols: s sequence, b micro-batch, h hidden, a heads, v vocabulary; i MLP size, g = kv/a."""

    s: int
    b: int
    h: int
    a: int
    v: int
    i: int
    g: float
    head_dim: int

    @property
    def sbh(self) -> int:
        return self.s * self.b * self.h


def paper_layer_bytes(d: Dims, tp: int, sp: bool, element: int) -> float:
    """Korthikanti et al. 2022, one transformer layer, scaled from 16-bit to `element` bytes."""
    linear = 34 / tp if sp or tp == 1 else 10 + 24 / tp
    return d.sbh * (linear + 5 * d.a * d.s / (d.h * tp)) * element / 2


def paper_outside_bytes(d: Dims, tp: int, sp: bool, element: int) -> tuple[float, float]:
    """The paper's activations outside the layers: (first stage: embedding, last stage: norm, head input and the
    fp32 cross-entropy), i.e. 4sbh(1 + v/h)/t in total at 16 bits (the sbh part not split without SP)."""
    split = tp if sp else 1
    return d.sbh * element / 2 / split, 3 * d.sbh * element / 2 / split + 4 * d.s * d.b * d.v / tp


def llama_layer_bytes(d: Dims, tp: int, sp: bool, element: int, attention: str) -> float:
    """One Llama decoder layer as this engine runs it (transformers' code, bytes saved for backward).

    Norms keep an fp32 copy of their input and the normalised output (4 + e bytes per element each); the q/k/v
    and gate/up inputs are saved whole, also under SP (the column-parallel layers save their all-gathered
    input); q, k, v, the attention output and the 4 MLP tensors (SiLU in/out, up out, down in) are split;
    scores: eager keeps the fp32 softmax (and its cast for 16-bit), sdpa a fp32 log-sum-exp of b*a*s.
    """
    e = element
    norms = 2 * (4 + e) / (tp if sp else 1)
    inputs = 2 * e
    split = (e * (1 + 2 * d.g) + e + 4 * e * d.i / d.h) / tp
    if attention == "eager":
        scores = (4 + (e if e != 4 else 0)) * d.a * d.s / d.h / tp
    else:
        scores = 4 * d.a / d.h / tp
    return d.sbh * (norms + inputs + split + scores)


def llama_outside_bytes(d: Dims, tp: int, sp: bool, element: int) -> tuple[float, float]:
    """(first stage: RoPE cos/sin, last stage: final norm, LM-head input (whole), fp32 vocab-parallel softmax)."""
    rope = 2 * d.s * d.head_dim * element
    last = d.sbh * ((4 + element) / (tp if sp else 1) + element) + 4 * d.s * d.b * d.v / tp
    return rope, last


# --------------------------------------------------------------------------------------------------------------
# Estimates


@dataclass
class MemoryEstimate:
    """Bytes on the rank with the most of them (each line is that line's maximum over ranks)."""

    layout: Layout
    workload: Workload
    parameters: float
    gradients: float
    optimizer_state: float
    buffers: float
    activations: float
    activations_paper: float
    activations_llama: float | None
    activation_method: str
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state + self.buffers + self.activations

    @property
    def states(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state


@dataclass
class _Counts:
    """Local parameter numel per pipeline stage (max over tp ranks), and the largest layer's local numel."""

    per_stage: list[int]
    largest_layer: int
    param_tensors: list[int]  # parameter tensors per stage (AdamW keeps one step counter per tensor)


class MemoryPlanner:
    """Estimates for one model (config read once, meta model built once, plans resolved per tp on demand)."""

    def __init__(self, model_dir_or_config, parallelize_embeddings: bool = True) -> None:
        self.config = load_config(model_dir_or_config)  # a config, a model directory or a config.json path
        self.model = build_meta_model(self.config)
        self.parallelize_embeddings = parallelize_embeddings
        from ..frontends.manager import ParallelizersManager

        self.parallelizer = ParallelizersManager.parallelizer_for_model(self.model)
        self._counts: dict[tuple[int, int], _Counts] = {}
        self._per_rank: dict[int, list[dict[str, int]]] = {}

    # ---- model facts

    @cached_property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @cached_property
    def _layer_prefix(self) -> str | None:
        try:
            prefix = self.parallelizer.pipeline_split_spec(self.model)
            layers = self.model.get_submodule(prefix)
        except (AttributeError, NotImplementedError):
            return None
        return prefix if isinstance(layers, nn.ModuleList) else None

    @cached_property
    def num_layers(self) -> int:
        config = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
        if self._layer_prefix is not None:
            return len(self.model.get_submodule(self._layer_prefix))
        if getattr(config, "is_encoder_decoder", False):  # encoder and decoder layers (the paper's layer each)
            return int(layers or 1) + int(getattr(config, "num_decoder_layers", None) or layers or 1)
        return int(layers or 1)

    @cached_property
    def dims_template(self) -> Dims:
        c = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        h = _first(c, "hidden_size", "n_embd", "d_model")
        a = _first(c, "num_attention_heads", "n_head", "num_heads")
        kv = getattr(c, "num_key_value_heads", None) or a
        i = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or getattr(c, "d_ff", None) or 4 * h
        head_dim = getattr(c, "head_dim", None) or h // a
        return Dims(s=0, b=0, h=h, a=a, v=c.vocab_size, i=i, g=kv / a, head_dim=head_dim)

    @property
    def llama_style(self) -> bool:
        return getattr(self.config, "model_type", None) in LLAMA_STYLE

    @property
    def supports_pipeline(self) -> bool:
        return bool(self.parallelizer.supports_pipeline_parallel) and self._layer_prefix is not None

    @property
    def supports_sequence_parallel(self) -> bool:
        return bool(self.parallelizer.supports_sequence_parallel)

    # ---- parameters

    def _segment(self) -> dict[str, int | str]:
        """Parameter name -> decoder layer index, or 'first' / 'last' for what sits before / after the layers."""
        prefix = self._layer_prefix
        segments: dict[str, int | str] = {}
        seen_layers = False
        for module_name, module in self.model.named_modules(remove_duplicate=False):
            if prefix is not None and module_name == prefix:
                seen_layers = True
            for param_name, _ in module.named_parameters(recurse=False, remove_duplicate=False):
                name = f"{module_name}.{param_name}" if module_name else param_name
                if prefix is not None and name.startswith(prefix + "."):
                    segments[name] = int(name[len(prefix) + 1 :].split(".", 1)[0])
                else:
                    segments[name] = "last" if seen_layers else "first"
        return segments

    def local_numel(self, tp: int) -> list[dict[str, int]]:
        """Per tp rank: parameter name (tied aliases too) -> local numel under the family's plan."""
        if tp not in self._per_rank:
            resolved = resolve_for_tp(self.model, tp, parallelize_embeddings=self.parallelize_embeddings)
            params = dict(self.model.named_parameters(remove_duplicate=False))
            self._per_rank[tp] = [
                {
                    name: (
                        numel(layout.local_shape)
                        if (layout := layouts.get(name)) is not None and layout.dim is not None
                        else p.numel()
                    )
                    for name, p in params.items()
                }
                for layouts in resolved.layouts
            ]
        return self._per_rank[tp]

    def counts(self, tp: int, pp: int) -> _Counts:
        """Local numel per pipeline stage on the tp rank holding the most, and the largest layer's local numel."""
        key = (tp, pp)
        if key in self._counts:
            return self._counts[key]
        if pp > 1 and not self.supports_pipeline:
            raise ValueError(f"{self.parallelizer.__name__} does not support pipeline parallelism (pp={pp})")
        if pp > self.num_layers:
            raise ValueError(f"pp={pp} is more pipeline stages than the model's {self.num_layers} layers")
        stages = stage_layers(self.num_layers, pp, "layers", "layers")
        stage_of_layer = {layer: s for s, layers in enumerate(stages) for layer in layers}
        segments = self._segment()
        ids = {name: id(p) for name, p in self.model.named_parameters(remove_duplicate=False)}
        per_stage, tensors, largest = [0] * pp, [0] * pp, 0
        for rank_numel in self.local_numel(tp):
            stage_sum, stage_tensors, seen = [0] * pp, [0] * pp, set()
            layer_sum: dict[int, int] = {}
            for name, n in rank_numel.items():
                segment = segments[name]
                stage = 0 if segment == "first" else pp - 1 if segment == "last" else stage_of_layer[segment]
                if (stage, ids[name]) in seen:  # tied: once per stage
                    continue
                seen.add((stage, ids[name]))
                stage_sum[stage] += n
                stage_tensors[stage] += 1
                if isinstance(segment, int):
                    layer_sum[segment] = layer_sum.get(segment, 0) + n
            per_stage = [max(a, b) for a, b in zip(per_stage, stage_sum, strict=True)]
            tensors = [max(a, b) for a, b in zip(tensors, stage_tensors, strict=True)]
            largest = max(largest, max(layer_sum.values(), default=0))
        self._counts[key] = _Counts(per_stage, largest, tensors)
        return self._counts[key]

    # ---- estimates

    def dims(self, workload: Workload) -> Dims:
        return replace(self.dims_template, s=workload.seq_len, b=workload.micro_batch)

    def activation_method(self, workload: Workload) -> str:
        if workload.activations == "llama" and not self.llama_style:
            raise ValueError(
                f"the Llama activation count covers model types {', '.join(LLAMA_STYLE)}, not "
                f"{self.config.model_type!r}; use activations='paper' or 'auto'"
            )
        if workload.activations == "auto":
            return "llama" if self.llama_style else "paper"
        return workload.activations

    def _activations(self, layout: Layout, workload: Workload, method: str) -> float:
        """The stage with the most activation bytes (1F1B: stage s keeps min(pp - s, m) micro-batches; GPipe: m)."""
        d, e, tp, sp, pp = self.dims(workload), workload.element, layout.tp, layout.sequence_parallel, layout.pp
        if method == "paper":
            layer = paper_layer_bytes(d, tp, sp, e)
            first, last = paper_outside_bytes(d, tp, sp, e)
        else:
            layer = llama_layer_bytes(d, tp, sp, e, workload.attention)
            first, last = llama_outside_bytes(d, tp, sp, e)
        micro = workload.num_microbatches or pp
        stages = stage_layers(self.num_layers, pp, "layers", "layers")
        worst = 0.0
        for s, layers in enumerate(stages):
            in_flight = micro if workload.schedule == "gpipe" else min(pp - s, micro)
            held = len(layers) * layer * in_flight
            held += first * in_flight if s == 0 else 0
            held += last if s == pp - 1 else 0
            worst = max(worst, held)
        return worst

    def estimate(self, layout: Layout, workload: Workload) -> MemoryEstimate:
        """Per-rank bytes of `layout` running `workload` (the rank with the most of each)."""
        if layout.sequence_parallel and not self.supports_sequence_parallel:
            raise ValueError(f"{self.parallelizer.__name__} does not support sequence parallelism")
        if workload.num_microbatches is not None and workload.num_microbatches < layout.pp:
            raise ValueError(f"num_microbatches={workload.num_microbatches} must be >= pp={layout.pp}")
        counts = self.counts(layout.tp, layout.pp)
        local = max(counts.per_stage)
        tensors = max(counts.param_tensors)
        e, dp, level = workload.element, layout.dp, layout.sharding_level
        if dp == 1:
            level = 0
        params = local * e / (dp if level >= 3 else 1)
        grads = local * e / (dp if level >= 2 else 1)
        state = (local * workload.optimizer_bytes_per_param + 4 * tensors) / (dp if level >= 1 else 1)
        notes = []
        if dp == 1:
            buffers = 0.0
        elif level <= 1:
            buffers = local * e  # DDP's gradient buckets, or the pipeline's flattened gradients
            where = "DDP's gradient buckets" if layout.pp == 1 else "the pipeline's flattened dp all-reduce buffer"
            notes.append(f"buffers: {where} (one more copy of the gradients)")
        elif level == 2:
            buffers = counts.largest_layer * e  # one block's unsharded gradients, the reduce-scatter input
            notes.append("buffers: FSDP2's reduce-scatter input (one block's unsharded gradients)")
        else:
            buffers = 3 * counts.largest_layer * e  # + the current and the prefetched block, gathered
            notes.append("buffers: FSDP2's current and prefetched gathered blocks and one block's reduce-scatter input")
        method = self.activation_method(workload)
        paper = self._activations(layout, workload, "paper")
        llama = self._activations(layout, workload, "llama") if self.llama_style else None
        activations = llama if method == "llama" else paper
        if workload.uses_master_weights:
            notes.append("optimizer: AdamW with fp32 master weights, m and v (12 bytes per parameter)")
        else:
            per_param = workload.optimizer_bytes_per_param
            notes.append(f"optimizer: AdamW, m and v in {workload.dtype} ({per_param} bytes per parameter)")
        if layout.pp > 1:
            m = workload.num_microbatches or layout.pp
            if workload.schedule == "gpipe":
                notes.append(f"activations: GPipe, every stage keeps all {m} micro-batches until its backward")
            else:
                notes.append(f"activations: 1F1B, the first stage keeps pp={layout.pp} of the {m} micro-batches")
            if layout.sequence_parallel:
                notes.append("optimum-parallel does not run sequence parallelism together with pp > 1 yet")
        if level == 1:
            notes.append("ZeRO-1 splits the optimizer state by whole parameters: ranks are only about even")
        return MemoryEstimate(layout, workload, params, grads, state, buffers, activations, paper, llama, method, notes)

    # ---- suggestions

    def candidate_layouts(self, devices: int) -> Iterator[Layout]:
        """Every (dp, tp, pp, sharding level, SP) this engine can run on `devices` ranks for this model."""
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise ValueError(f"devices={devices!r} is not allowed; it must be a positive integer")
        for tp in _divisors(devices):
            try:
                self.local_numel(tp)
            except (ValueError, NotImplementedError):
                continue  # the family's plan cannot split this model over tp ranks (heads)
            for pp in _divisors(devices // tp):
                if pp > 1 and (not self.supports_pipeline or pp > self.num_layers):
                    continue
                dp = devices // (tp * pp)
                for level in (0, 1, 2, 3) if dp > 1 else (0,):
                    sp_options = (False, True) if tp > 1 and pp == 1 and self.supports_sequence_parallel else (False,)
                    for sp in sp_options:
                        yield Layout(dp, tp, pp, level, sp)

    def suggest(
        self, devices: int, memory_bytes: float, workload: Workload, reserve: float = 0.1
    ) -> list[MemoryEstimate]:
        """The layouts whose estimate fits `memory_bytes` x (1 - reserve), best first: fewest tp ranks (tp
        communication sits on every layer's critical path), then fewest pipeline stages (bubble), then the
        lowest sharding level (level 3 re-gathers parameters every forward and backward), then most headroom."""
        if not 0 <= reserve < 1:
            raise ValueError(f"reserve={reserve!r} is not allowed; it is a fraction in [0, 1)")
        if memory_bytes <= 0:
            raise ValueError(f"memory={memory_bytes!r} bytes is not allowed; it must be positive")
        budget = memory_bytes * (1 - reserve)
        estimates = (self.estimate(layout, workload) for layout in self.candidate_layouts(devices))
        fits = [est for est in estimates if est.total <= budget]
        return sorted(fits, key=lambda est: (est.layout.tp, est.layout.pp, est.layout.sharding_level, est.total))


def estimate_memory(
    model_dir_or_config,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    sharding_level: int = 0,
    sequence_parallel: bool = False,
    **workload,
) -> MemoryEstimate:
    """Per-rank memory of one layout (see `MemoryPlanner.estimate`); `workload`: `Workload`'s fields."""
    return MemoryPlanner(model_dir_or_config).estimate(
        Layout(dp, tp, pp, sharding_level, sequence_parallel), Workload(**workload)
    )


def suggest_layouts(
    model_dir_or_config, devices: int, memory_gib: float, reserve: float = 0.1, **workload
) -> list[MemoryEstimate]:
    """The layouts that fit `devices` devices of `memory_gib` GiB, best first (see `MemoryPlanner.suggest`)."""
    return MemoryPlanner(model_dir_or_config).suggest(devices, memory_gib * GIB, Workload(**workload), reserve)


# --------------------------------------------------------------------------------------------------------------
# Text


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


def format_estimate(planner: MemoryPlanner, off: MemoryEstimate, on: MemoryEstimate | None) -> str:
    """A table of one layout without (and with) sequence parallelism, bytes per rank in a readable unit."""
    layout = off.layout
    method = {"llama": "Llama count", "paper": "Korthikanti et al. 2022"}[off.activation_method]
    columns = [off] + ([on] if on is not None else [])
    unit, scale = pick_unit(max(e.total for e in columns))
    lines = [
        describe_model(planner, off.workload),
        f"layout: dp={layout.dp} tp={layout.tp} pp={layout.pp}, sharding level {layout.sharding_level}; "
        f"{unit} on the rank with the most",
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
    lines += table(header, rows, align_numbers=True)
    notes = list(dict.fromkeys(n for e in columns for n in e.notes))
    if on is None and layout.tp > 1:
        notes.append(f"{planner.parallelizer.__name__} has no sequence-parallel plan: SP on is not shown")
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
        "fewest pp, then lowest sharding level, then most headroom"
    )
    if not estimates:
        return "\n".join(lines) + "\n"
    unit, scale = pick_unit(max(e.total for e in estimates[:top]))
    rows = []
    for rank, e in enumerate(estimates[:top], 1):
        sizes = (e.parameters, e.gradients, e.optimizer_state, e.buffers, e.activations, e.total)
        layout = (e.layout.dp, e.layout.tp, e.layout.pp, e.layout.sharding_level)
        sp = "on" if e.layout.sequence_parallel else "off"
        free = f"{1 - e.total / memory_bytes:.0%}"
        rows.append([str(rank), *map(str, layout), sp, *(in_unit(n, scale) for n in sizes), free])
    header = ["#", "dp", "tp", "pp", "level", "SP", "params", "grads", "optim", "buffers", "activ."]
    header += [f"total {unit}", "free"]
    lines += ["", *table(header, rows, align_numbers=True)]
    if len(estimates) > top:
        lines.append(f"... {len(estimates) - top} more (--top N shows more)")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------------------


def _first(config, *names: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"{type(config).__name__} has none of {', '.join(names)}; cannot size the activations")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
