"""Resolving a plan on one process: the model on the meta device, a simulated mesh, every rank's layouts.

The layouts come from the styles' own `param_specs` (the same specs they split by when they run), so a plan
resolved here at tp=8 is exactly what eight processes would hold.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import nn

from ..engine.checks import validate
from ..frontends.family_request import family_request
from ..frontends.manager import ParallelizersManager
from ..frontends.parallelizer import Parallelizer
from ..mesh import SimulatedMesh, check_positive_int
from ..plan import check_plan
from ..styles import ParallelStyle
from ..tensor_parallel.spec import ShardLayout


def load_config(model_dir_or_config):
    """A transformers config from a model directory or config.json path (a config passes through)."""
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


def style_name(style: ParallelStyle) -> str:
    """The style with the arguments that differ from its defaults: `ColWiseParallel(units=8)`."""
    try:
        defaults = vars(type(style)())
    except TypeError:  # a style with required arguments
        defaults = {}
    shown = {k: v for k, v in vars(style).items() if k not in defaults or defaults[k] != v}
    shown = {k: v for k, v in shown.items() if not callable(v)}
    return type(style).__name__ + (f"({', '.join(f'{k}={v}' for k, v in shown.items())})" if shown else "")


@dataclass
class ResolvedPlan:
    """A plan resolved against an unparallelized (meta) model for every rank of a simulated tp group."""

    model: nn.Module  # untouched
    parallelizer: type[Parallelizer] | None  # None for a user plan
    tp: int
    targets: dict[str, list[ParallelStyle]]  # module name -> styles, in model order
    layouts: list[dict[str, ShardLayout]]  # per tp rank: parameter name (tied aliases too) -> layout
    styles: dict[str, list[str]] = field(default_factory=dict)  # parameter name -> names of the styles acting on it


def resolve_for_tp(
    model: nn.Module,
    tp: int,
    plan: Mapping[str, object] | None = None,
    parallelize_embeddings: bool = True,
    sequence_parallel_enabled: bool = False,
) -> ResolvedPlan:
    """Check and resolve `plan` (default: the family's plan) for `tp` ranks without a process group."""
    check_positive_int("tp", tp, "the tensor-parallel size")
    mesh = SimulatedMesh(tp)
    parallelizer = None
    if plan is None:
        parallelizer = ParallelizersManager.parallelizer_for_model(model)
        # the engine's checks of the family's request (its capabilities, its own model check, its plan) at this tp
        request = parallelizer.request(parallelize_embeddings, sequence_parallel_enabled)
        plan = validate(request, model, mesh, partial(family_request, parallelizer)).request.plan
    targets = check_plan(model, plan, mesh)
    layouts: list[dict[str, ShardLayout]] = [{} for _ in range(tp)]
    styles_of: dict[str, list[str]] = {}
    for name, module_styles in targets.items():
        module = model.get_submodule(name)
        prefix = f"{name}." if name else ""
        for style in module_styles:
            specs = style.param_specs(module)
            for param in specs or {n for n, _ in module.named_parameters(recurse=False)}:
                styles_of.setdefault(prefix + param, []).append(style_name(style))
            for rank in range(tp):
                layouts[rank].update({prefix + param: spec.local(rank, tp) for param, spec in specs.items()})
    return ResolvedPlan(model, parallelizer, tp, targets, layouts, styles_of)


def simulate_plan(model_dir_or_config, tp: int, parallelize_embeddings: bool = True) -> ResolvedPlan:
    """Build the model on meta from its config, pick its parallelizer, resolve its plan for each of `tp` ranks."""
    check_positive_int("tp", tp, "the tensor-parallel size")
    model = build_meta_model(load_config(model_dir_or_config))
    return resolve_for_tp(model, tp, parallelize_embeddings=parallelize_embeddings)
