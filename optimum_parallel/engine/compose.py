"""The composition order, written once: TP/SP plan -> expert parallel -> context parallel -> pipeline split ->
materialise -> optimizer -> data parallel, from the `ResolvedRequest` that `checks.validate` returns. `compose` runs
every step and returns what it installed (`runtime.py`); the Trainer runs the model half (`compose_model`) before
transformers' Trainer exists and the training half (`compose_training`) once it has built its optimizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..context_parallel import apply_context_parallel
from ..data_parallel.levels import DataParallelConfig, apply_data_parallel
from ..expert_parallel import apply_expert_parallel
from ..mesh import ParallelMesh
from ..mixers import install_mixers
from ..packing import install_packing
from ..pipeline import SPLIT_BACKWARD
from ..pipeline.batches import stage_batches
from ..plan.apply import AppliedPlan, apply_checked_plan
from ..plan.optimizer import rebuild_optimizer, shard_states_in_place
from ..plan.parameters import keep_original_parameters
from ..state import find_state, parallel_state
from .compile import compile_blocks
from .guards import install_guards
from .lazy_optimizer import build_lazy_optimizer, is_lazy_optimizer
from .materialize import materialize_lazy_model, move_to_device
from .request import ResolvedRequest
from .rng import install_tp_random
from .runtime import ParallelRuntime, ParamMap

if TYPE_CHECKING:
    from ..comm.tp_entry import SequenceRegion
    from ..pipeline.torch_pipelining import Pipeline
    from .request import PipelineSettings


def compose_model(model: nn.Module, mesh: ParallelMesh, resolved: ResolvedRequest) -> ParallelRuntime:
    """Steps 1-4 of a validated request: make `model` tensor/sequence-, expert-, context- and pipeline-parallel in
    place; returns what was installed, kept on the model too (`parallel_state(model).runtime`; its `param_map`:
    {id(original parameter): parallel parameter, or None on another stage}, for the optimizer). A model composed
    before keeps its packing hook and guards: they are not installed twice."""
    request, before = resolved.request, _installed(model)
    originals = {id(p): p for p in model.parameters()}
    applied = _apply_plan(model, mesh, resolved)  # 1. TP/SP on the whole model, then the family's fix-ups
    moved = _split_experts(model, mesh)  # 1b. EP, after the plan: each rank splits its tp slices
    mapping = keep_original_parameters(model, originals, _chained(originals, applied, moved))
    install_tp_random(model, mesh, applied.layers if applied is not None else None)
    packing = _install_packing(model, mesh, resolved.pipeline, before.packing if before is not None else False)
    _apply_context_parallel(model, mesh, request.context_parallel)  # 2. CP
    _install_mixers(model, mesh, resolved)  # 2b. mixers carrying a state: documents apart, the sequence across cp
    pipeline = _split_pipeline(model, mesh, resolved.pipeline, applied.sequence if applied is not None else None)
    mapping = _on_this_rank(model, mapping, pipeline)  # 3. other stages' parameters map to None
    materialize_lazy_model(model, request.device, read_checkpoint=request.read_checkpoint)  # 4. this rank's slices
    move_to_device(model, request.device)
    compile_blocks(model, resolved.compile)  # traced at the first call: wrappers added later are what it sees
    guarded = install_guards(model, mesh, request.shared_batch, before is not None and before.guarded)
    layers, sequence = _plan_installed(applied, before)
    state = parallel_state(model)
    state.runtime = ParallelRuntime(
        model=model,
        param_map=mapping,
        tensor_parallel_layers=layers,
        sequence=sequence,
        expert_parallel=state.expert_parallel,
        context_parallel=state.context_parallel,
        pipeline=state.pipeline,
        packing=packing,
        guarded=guarded,
        compile=resolved.compile or (before.compile if before is not None else None),
    )
    return state.runtime


def compose_training(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    mesh: ParallelMesh,
    mapping: Mapping[int, nn.Parameter | None],
    data_parallel: DataParallelConfig | None,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Rebuild `optimizer` over the parallel parameters, then make the model data-parallel."""
    # 5. The optimizer over the parallel parameters (a lazy one is built here for the first time).
    if optimizer is not None:
        optimizer = optimizer_for_parallel_model(optimizer, mapping)
    # 6. Data parallel last: FSDP2 shards the already tp-split parameters; DDP/ZeRO-1 see the final ones.
    if data_parallel is not None:
        model, optimizer = apply_data_parallel(model, optimizer, mesh, data_parallel)
    return model, optimizer


def compose(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, mesh: ParallelMesh, resolved: ResolvedRequest
) -> ParallelRuntime:
    """Every step in order, for a request `validate` accepted; returns what was installed, with the (data-parallel)
    model and the optimizer over its parameters."""
    installed = compose_model(model, mesh, resolved)
    parallel, optimizer = compose_training(model, optimizer, mesh, installed.param_map, resolved.data_parallel)
    level = parallel_state(model).data_parallel_level
    return replace(installed, model=parallel, optimizer=optimizer, data_parallel_level=level)


def optimizer_for_parallel_model(
    optimizer: torch.optim.Optimizer, mapping: Mapping[int, nn.Parameter | None]
) -> torch.optim.Optimizer:
    """A lazy optimizer built for the first time, or a regular one rebuilt, over the parameters `mapping` gives;
    the same object when nothing changed (a data-parallel-only layout)."""
    if is_lazy_optimizer(optimizer):
        return build_lazy_optimizer(optimizer, mapping)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    empty = any(not group["params"] for group in optimizer.param_groups)  # a rebuilt optimizer drops them
    if all(mapping.get(id(p), p) is p for p in params) and not empty:  # the parameters hold their shards in place
        shard_states_in_place(optimizer)
        return optimizer
    return rebuild_optimizer(optimizer, mapping)


# ---------------------------------------------------------------------------------------------- the steps' details


def _installed(model: nn.Module) -> ParallelRuntime | None:
    """What an earlier composition of `model` installed (None: it was never composed)."""
    state = find_state(model)
    return state.runtime if state is not None else None


def _apply_plan(model: nn.Module, mesh: ParallelMesh, resolved: ResolvedRequest) -> AppliedPlan | None:
    """TP/SP by the checked plan (every rank resolves and checks the same plan, tied weights stay tied), then the
    family's fix-ups of module attributes (local head counts, config views). The layers' wirings follow from the whole
    request: schedules that defer weight gradients turn the overlap off."""
    applied = None
    if resolved.module_styles is not None:
        overlap = resolved.pipeline is None or resolved.pipeline.schedule not in SPLIT_BACKWARD
        applied = apply_checked_plan(model, resolved.module_styles, mesh, overlap=overlap)
    if resolved.after_plan is not None:
        resolved.after_plan(model, mesh)
    return applied


def _split_experts(model: nn.Module, mesh: ParallelMesh) -> dict[int, nn.Parameter]:
    """The experts split along the expert dim over the ep ranks sharing the dense weights, tokens dispatched to them
    by all-to-all (once per model); {id(old parameter): new one}."""
    state = find_state(model)
    if mesh.size("ep") == 1 or (state is not None and state.expert_parallel is not None):
        return {}
    return apply_expert_parallel(model, mesh.expert_group, mesh.size("ep"), mesh.rank("ep"))


def _chained(originals: ParamMap, applied: AppliedPlan | None, moved: Mapping[int, nn.Parameter]) -> ParamMap:
    """{id(original parameter): the parameter the plan, then expert parallelism, made of it}."""
    mapping = {**originals, **(applied.param_map if applied is not None else {})}
    return {k: (moved.get(id(v), v) if v is not None else None) for k, v in mapping.items()}


def _install_packing(model: nn.Module, mesh: ParallelMesh, pipeline: PipelineSettings | None, installed: bool) -> bool:
    """Packed rows (several documents per row, told apart by restarting position ids, cu_seq_lens or seq_idx): without
    cp or pp a forward pre-hook puts them in the form the model's own mask builders turn into a document mask; cp's
    input split and the pipeline's batch functions read that form themselves. True when the hook is on the model."""
    if installed:
        return True
    if mesh.size("cp") > 1 or pipeline is not None:
        return False
    install_packing(model)
    return True


def _apply_context_parallel(model: nn.Module, mesh: ParallelMesh, strategy: str) -> None:
    """Attention over the cp ring, each rank's forward cut to its chunks of the sequence (weights untouched)."""
    if mesh.size("cp") > 1:
        apply_context_parallel(model, mesh.group("cp"), strategy)


def _install_mixers(model: nn.Module, mesh: ParallelMesh, resolved: ResolvedRequest) -> None:
    """Every token mixer carrying a state (gated delta nets, Mamba mixers, short convolutions) runs one device's
    answer: each packed document alone, and under cp on the whole sequence, its heads split over cp (or whole)."""
    if not resolved.mixers:
        return
    cp = mesh.size("cp")
    group = mesh.group("cp") if cp > 1 else None
    layout_rank = parallel_state(model).context_parallel.layout_rank if cp > 1 else None
    tp = (mesh.rank("tp"), mesh.size("tp")) if resolved.module_styles is not None else (0, 1)
    install_mixers(model, resolved.mixers, tp, group, layout_rank)


def _split_pipeline(
    model: nn.Module, mesh: ParallelMesh, pipeline: PipelineSettings | None, sequence: SequenceRegion | None
) -> Pipeline | None:
    """The rank keeps its stages, fed by the pipeline's batch functions (packed rows; cp's cut of the sequence)."""
    if pipeline is None:
        return None
    from ..pipeline.torch_pipelining import apply_pipeline  # torch's pipelining (and torch._dynamo) load only here

    batches = stage_batches(model, context_parallel=mesh.size("cp") > 1)
    return apply_pipeline(
        model,
        mesh,
        pipeline.split_spec,
        pipeline.num_microbatches,
        pipeline.schedule,
        batches=batches,
        sequence=sequence,
    )


def _on_this_rank(model: nn.Module, mapping: ParamMap, pipeline: Pipeline | None) -> ParamMap:
    """`mapping` with the parameters of the stages other ranks hold mapped to None (unchanged without pp)."""
    if pipeline is None:
        return mapping
    present = {id(p) for p in model.parameters()}
    return {k: (v if id(v) in present else None) for k, v in mapping.items()}


def _plan_installed(
    applied: AppliedPlan | None, before: ParallelRuntime | None
) -> tuple[Mapping[str, str], SequenceRegion | None]:
    """The tensor-parallel layers and sequence region on the model: this composition's plan, else an earlier one's
    (a model parallelized by the Parallelizer, then given data parallelism by `parallelize`)."""
    if applied is not None:
        return applied.layers, applied.sequence
    if before is not None:
        return before.tensor_parallel_layers, before.sequence
    return {}, None
