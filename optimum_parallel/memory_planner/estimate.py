"""Memory planner: per-rank bytes of parameters, gradients, optimizer state and activations for a dp x pp x cp x tp
layout with a data-parallel sharding level, from a transformers config alone (a meta model, no weights).

Parameters are counted from the family's plan resolved at the simulated tp, per pipeline stage; the rank with the
most bytes is reported. The assumptions (optimizer, sharding levels, experts, buffers, activation formulas) are in
every estimate's `notes` and in docs/module_notes.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import replace
from functools import cached_property, partial

from torch import nn

from ..autoplan.capabilities import LLAMA_ACTIVATIONS
from ..data_parallel.levels import DataParallelConfig
from ..engine.checks import validate
from ..engine.layouts import layout_mesh
from ..engine.request import ParallelRequest
from ..frontends.family_request import family_request
from ..pipeline.split import stage_layers
from .activations import (
    Dims,
    activation_bytes,
    llama_layer_bytes,
    paper_layer_bytes,
    ring_attention_layer_bytes,
)
from .expert_facts import ExpertFacts, dispatch_layer_bytes
from .memory_text import format_estimate, format_suggestions, in_unit, pick_unit
from .simulate import build_meta_model, load_config, resolve_for_tp
from .stage_counts import StageCounts, state_bytes
from .tables import numel
from .workload import DTYPES, GIB, PLANNER_KEYS, Layout, MemoryEstimate, Workload, parse_dtype

__all__ = [  # the formulas, value types and text beside this module still import from here
    "DTYPES",
    "GIB",
    "Dims",
    "Layout",
    "MemoryEstimate",
    "MemoryPlanner",
    "Workload",
    "estimate_memory",
    "format_estimate",
    "format_suggestions",
    "in_unit",
    "llama_layer_bytes",
    "paper_layer_bytes",
    "parse_dtype",
    "pick_unit",
    "suggest_layouts",
]


class MemoryPlanner:
    """Estimates for one model (config read once, meta model built once, plans resolved per tp on demand)."""

    def __init__(self, model_dir_or_config, parallelize_embeddings: bool = True) -> None:
        self.config = load_config(model_dir_or_config)  # a config, a model directory or a config.json path
        self.model = build_meta_model(self.config)
        self.parallelize_embeddings = parallelize_embeddings
        from ..frontends.manager import ParallelizersManager

        self.parallelizer = ParallelizersManager.parallelizer_for_model(self.model)
        # what the model supports beyond tp, as both entry points resolve it: its family's declaration, or its structure
        self.capabilities = self.parallelizer.capabilities_for(self.model)
        self._refusals: dict[tuple[Layout, int, str], str | None] = {}
        self._counts: dict[tuple[int, int, int], StageCounts] = {}
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
        return Dims.from_config(self.config)

    @property
    def llama_style(self) -> bool:
        return self.capabilities.activations == LLAMA_ACTIVATIONS

    @cached_property
    def experts(self) -> ExpertFacts:
        """The model's stacked-experts modules (none for a dense model)."""
        return ExpertFacts.of(self.model)

    @cached_property
    def _moe_layers(self) -> set[int]:
        """Indices of the decoder layers holding a stacked-experts module."""
        segments = self._segment()
        return {segments[n] for n in self.experts.names if isinstance(segments.get(n), int)}

    # ---- what the engine runs

    def request(self, layout: Layout, workload: Workload | None = None) -> ParallelRequest:
        """The request the family's `Parallelizer` makes for `layout` running `workload`, as the engine checks it: the
        family's plan (sequence parallelism as asked), `workload`'s micro-batches (default pp) and schedule, the data
        parallelism of the sharding level and shard size over dp x cp ranks."""
        workload = workload or Workload()
        data_parallel = None
        if layout.data_parallel > 1:
            data_parallel = DataParallelConfig(sharding_level=layout.sharding_level, shard_size=layout.shard_size)
        return self.parallelizer.request(
            self.parallelize_embeddings,
            layout.sequence_parallel,
            pipeline_parallel_num_microbatches=workload.num_microbatches or layout.pp,
            pipeline_parallel_schedule=workload.schedule,
            data_parallel=data_parallel,
            keys=PLANNER_KEYS,
        )

    def check(self, layout: Layout, workload: Workload | None = None) -> None:
        """Raise the engine's error (naming the setting and the allowed values) if it refuses `layout` running
        `workload` for this model: the family's `Parallelizer` request checked over a mesh of sizes alone. The
        planner's one call into the engine's checks (`frontends/family_request.py` over `engine/layouts.py`'s mesh)."""
        mesh = layout_mesh(layout.mesh_sizes)
        validate(self.request(layout, workload), self.model, mesh, partial(family_request, self.parallelizer))

    def refusal(self, layout: Layout, workload: Workload | None = None) -> str | None:
        """Why the engine refuses `layout` for this model (its error's message), or None if it runs it (cached)."""
        workload = workload or Workload()
        key = (layout, workload.num_microbatches or layout.pp, workload.schedule)
        if key not in self._refusals:
            try:
                self.check(layout, workload)
                self._refusals[key] = None
            except (ValueError, NotImplementedError) as err:
                self._refusals[key] = str(err)
        return self._refusals[key]

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

    def counts(self, tp: int, pp: int, ep: int = 1) -> StageCounts:
        """Local numel per pipeline stage on the tp rank holding the most, and the largest layer's local numel;
        expert tensors hold num_experts / ep experts each."""
        key = (tp, pp, ep)
        if key in self._counts:
            return self._counts[key]
        stages = stage_layers(self.num_layers, pp, "layers", "layers")
        stage_of_layer = {layer: s for s, layers in enumerate(stages) for layer in layers}
        segments = self._segment()
        ids = {name: id(p) for name, p in self.model.named_parameters(remove_duplicate=False)}
        per_stage, tensors, largest, most_experts = [0] * pp, [0] * pp, 0, 0
        expert_stage, expert_tensors = [0] * pp, [0] * pp
        for rank_numel in self.local_numel(tp):
            stage_sum, stage_tensors, seen, expert_sum = [0] * pp, [0] * pp, set(), 0
            stage_experts, stage_expert_tensors = [0] * pp, [0] * pp
            layer_sum: dict[int, int] = {}
            for name, n in rank_numel.items():
                segment = segments[name]
                stage = 0 if segment == "first" else pp - 1 if segment == "last" else stage_of_layer[segment]
                if name in self.experts.names:
                    n //= ep  # whole experts: ep divides every block's count (checked by `estimate`)
                    expert_sum += n
                    stage_experts[stage] += n
                    stage_expert_tensors[stage] += 1
                if (stage, ids[name]) in seen:  # tied: once per stage
                    continue
                seen.add((stage, ids[name]))
                stage_sum[stage] += n
                stage_tensors[stage] += 1
                if isinstance(segment, int):
                    layer_sum[segment] = layer_sum.get(segment, 0) + n
            per_stage = [max(a, b) for a, b in zip(per_stage, stage_sum, strict=True)]
            tensors = [max(a, b) for a, b in zip(tensors, stage_tensors, strict=True)]
            expert_stage = [max(a, b) for a, b in zip(expert_stage, stage_experts, strict=True)]
            expert_tensors = [max(a, b) for a, b in zip(expert_tensors, stage_expert_tensors, strict=True)]
            largest = max(largest, max(layer_sum.values(), default=0))
            most_experts = max(most_experts, expert_sum)
        self._counts[key] = StageCounts(per_stage, largest, tensors, most_experts, expert_stage, expert_tensors)
        return self._counts[key]

    # ---- estimates

    def dims(self, workload: Workload, cp: int = 1) -> Dims:
        """The sizes of one micro-batch on one rank: s is the rank's share of the sequence under cp (rounded up)."""
        return replace(self.dims_template, s=-(-workload.seq_len // cp), b=workload.micro_batch)

    def activation_method(self, workload: Workload) -> str:
        if workload.activations == "llama" and not self.llama_style:
            from ..frontends.manager import ParallelizersManager

            llama = ParallelizersManager.model_types_with(lambda c: c.activations == LLAMA_ACTIVATIONS)
            raise ValueError(
                f"the Llama activation count covers model types {', '.join(llama)}, not "
                f"{self.config.model_type!r}; use activations='paper' or 'auto'"
            )
        if workload.activations == "auto":
            return "llama" if self.llama_style else "paper"
        return workload.activations

    def _activations(self, layout: Layout, workload: Workload, method: str) -> float:
        """The stage with the most activation bytes (1F1B: stage s keeps min(pp - s, m) micro-batches; GPipe: m);
        under cp, those of the rank's s/cp tokens and ring attention's K/V blocks."""
        pp = layout.pp
        local = self.dims(workload, layout.cp)
        layer, first, last = activation_bytes(
            method, local, layout.tp, layout.sequence_parallel, workload.element, workload.attention
        )
        layer += ring_attention_layer_bytes(self.dims(workload), layout.cp, layout.tp, workload.element)
        dispatch = 0.0  # the dispatched rows of each MoE layer under ep
        if layout.ep > 1:
            dispatch = dispatch_layer_bytes(local.s, local.b, local.h, self.experts.top_k, workload.element)
        micro = workload.num_microbatches or pp
        stages = stage_layers(self.num_layers, pp, "layers", "layers")
        worst = 0.0
        for s, layers in enumerate(stages):
            in_flight = micro if workload.schedule == "gpipe" else min(pp - s, micro)
            moe = len(self._moe_layers & set(layers))
            held = (len(layers) * layer + moe * dispatch) * in_flight
            held += first * in_flight if s == 0 else 0
            held += last if s == pp - 1 else 0
            worst = max(worst, held)
        return worst

    def estimate(self, layout: Layout, workload: Workload) -> MemoryEstimate:
        """Per-rank bytes of `layout` running `workload` (the rank with the most of each); raises the engine's error
        (naming the setting and the allowed values) for a layout it refuses."""
        if self.refusal(layout, workload) is not None:
            self.check(layout, workload)  # raises the engine's error
        counts = self.counts(layout.tp, layout.pp, layout.ep)
        # levels shard over the sharding group: all dp x cp ranks, or shard_size of them (hybrid sharding); under ep
        # the experts' states over the ranks holding the same experts
        e, dp, level, group = workload.element, layout.data_parallel, layout.sharding_level, layout.sharding_group
        if dp == 1:
            level = 0
        params, grads, state = state_bytes(counts, layout, workload, level)
        notes = []
        if dp == 1:
            buffers = 0.0
        elif layout.ep > 1 and level <= 1:  # DDP buckets (or under pp the pipeline's) for the dense parameters, one
            replicated = layout.expert_replicas > 1  # flat all-reduce for the experts' gradients
            buffers = max(
                dense * e + (experts * e if replicated else 0)
                for (dense, _), (experts, _) in map(counts.split, range(layout.pp))
            )
            flat = " and the expert gradients' flat all-reduce buffer" if replicated else ""
            where = "DDP's gradient buckets" if layout.pp == 1 else "the pipeline's flattened dp all-reduce buffer"
            notes.append(f"buffers: {where} of the dense parameters{flat}")
        elif level <= 1:
            local = max(counts.per_stage)
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
        if level == 1:
            notes.append("ZeRO-1 splits the optimizer state by whole parameters: ranks are only about even")
        if level >= 1 and group < dp:
            notes.append(
                f"hybrid sharding: states split over groups of {group} ranks, replicated over the {dp // group} groups"
            )
        if layout.ep > 1:
            experts = self.experts
            sharded = (
                f", then / {layout.expert_replicas} (the dp x cp / ep ranks holding them) at sharding level {level}"
                if level
                else ""
            )
            notes.append(
                f"ep={layout.ep}: {max(experts.counts) // layout.ep} of {max(experts.counts)} experts per MoE block on "
                f"each rank (expert weights, gradients and AdamW state / ep{sharded}); activations add the dispatched "
                f"rows, 2·s·b·k·h per MoE layer (k={experts.top_k}, balanced routing)"
            )
        if layout.cp > 1:
            notes.append(
                f"cp={layout.cp}: activations of seq/cp tokens per rank plus ring attention's 2 K/V blocks in flight "
                "per layer; every cp rank holds the same parameters (sharding levels split them over dp x cp)"
            )
        snapshot = 0.0
        if workload.async_save:  # the writing rank holds its stage's whole shards (FSDP2 / ZeRO-1 gathered to it)
            whole_params, _, whole_state = state_bytes(counts, layout, workload, 0)
            snapshot = whole_params + whole_state
            notes.append(
                "async save: the writing rank's snapshot of its weights and optimizer state in host memory (pinned on "
                "GPUs), one at a time, freed once written; not in the total (on a CPU it shares the same memory)"
            )
        return MemoryEstimate(
            layout, workload, params, grads, state, buffers, activations, paper, llama, method, notes, snapshot
        )

    # ---- suggestions

    def candidate_layouts(self, devices: int, workload: Workload | None = None) -> Iterator[Layout]:
        """Every (dp, tp, pp, cp, sharding level, SP, ep) on `devices` ranks that the engine runs for this model
        (`refusal`): tp and pp dividing the devices, cp (1, 2, 4, 8) only where `workload`'s sequence splits into 2
        x cp chunks of at least cp tokens (only cp=1 without a workload), every sharding level where dp x cp > 1,
        SP on and off where tp > 1, ep dividing dp x cp for a model whose experts the planner counts. Hybrid
        sharding is not proposed."""
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise ValueError(f"devices={devices!r} is not allowed; it must be a positive integer")
        for tp in _divisors(devices):
            for pp in _divisors(devices // tp):
                for cp in _cp_sizes(devices // (tp * pp), workload):
                    dp = devices // (tp * pp * cp)
                    levels = (0, 1, 2, 3) if dp * cp > 1 else (0,)
                    eps = _divisors(dp * cp) if self.experts.counts else [1]
                    sps = (False, True) if tp > 1 else (False,)
                    for level, ep, sp in itertools.product(levels, eps, sps):
                        layout = Layout(dp, tp, pp, level, sp, cp, ep=ep)
                        if self.refusal(layout, workload) is None:
                            yield layout

    def suggest(
        self, devices: int, memory_bytes: float, workload: Workload, reserve: float = 0.1
    ) -> list[MemoryEstimate]:
        """The layouts whose estimate fits `memory_bytes` x (1 - reserve), best first: fewest tp ranks (tp
        communication sits on every layer's critical path), then fewest pipeline stages (bubble), then fewest cp
        ranks (ring attention hides its K/V passes behind attention, mostly), then the lowest sharding level (level
        3 re-gathers parameters every forward and backward), then fewest ep ranks (two all-to-alls per MoE layer
        each way, which beat a sharding level: ep at level 0 comes before ep=1 at level 1), then most headroom. So
        cp > 1 comes first exactly when the sequence is long enough that activations only fit split, and before tp
        or pp would be needed."""
        if not 0 <= reserve < 1:
            raise ValueError(f"reserve={reserve!r} is not allowed; it is a fraction in [0, 1)")
        if memory_bytes <= 0:
            raise ValueError(f"memory={memory_bytes!r} bytes is not allowed; it must be positive")
        budget = memory_bytes * (1 - reserve)
        estimates = (self.estimate(layout, workload) for layout in self.candidate_layouts(devices, workload))
        fits = [est for est in estimates if est.total <= budget]
        return sorted(fits, key=_preference)


def estimate_memory(
    model_dir_or_config,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    sharding_level: int = 0,
    sequence_parallel: bool = False,
    cp: int = 1,
    shard_size: int = -1,
    ep: int = 1,
    **workload,
) -> MemoryEstimate:
    """Per-rank memory of one layout (see `MemoryPlanner.estimate`); `workload`: `Workload`'s fields."""
    return MemoryPlanner(model_dir_or_config).estimate(
        Layout(dp, tp, pp, sharding_level, sequence_parallel, cp, shard_size, ep), Workload(**workload)
    )


def suggest_layouts(
    model_dir_or_config, devices: int, memory_gib: float, reserve: float = 0.1, **workload
) -> list[MemoryEstimate]:
    """The layouts that fit `devices` devices of `memory_gib` GiB, best first (see `MemoryPlanner.suggest`)."""
    return MemoryPlanner(model_dir_or_config).suggest(devices, memory_gib * GIB, Workload(**workload), reserve)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


CP_SIZES = (1, 2, 4, 8)


def _cp_sizes(ranks: int, workload: Workload | None) -> list[int]:
    """The cp sizes worth trying on `ranks` ranks: they divide it, and the sequence cuts into 2 x cp load-balanced
    chunks of at least cp tokens each (cp <= seq / (2 cp)); only cp=1 without a workload."""
    if workload is None:
        return [1]
    seq = workload.seq_len
    return [1] + [cp for cp in CP_SIZES[1:] if ranks % cp == 0 and seq % (2 * cp) == 0 and cp <= seq // (2 * cp)]


def _preference(estimate: MemoryEstimate) -> tuple:
    layout = estimate.layout
    return (layout.tp, layout.pp, layout.cp, layout.sharding_level, layout.ep, estimate.total)
