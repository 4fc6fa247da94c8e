"""The composition order, written once: validate -> TP/SP plan -> expert parallel -> context parallel ->
pipeline split -> materialise -> optimizer -> data parallel.

Both front doors (`Parallelizer.parallelize`, `parallelize(model, optimizer, mesh, config)`) and the Trainer
translate their arguments into one `ParallelRequest`, which `validate` checks whole (`validate.py`); the steps below
take the `CheckedRequest` it returns. `compose` runs every step; the Trainer runs the model half (`compose_model`)
before transformers' Trainer exists and the training half (`compose_training`) once it has built its optimizer, in the
same order.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..context_parallel import apply_context_parallel, pipeline_functions
from ..expert_parallel import apply_expert_parallel
from ..mesh import ParallelMesh
from ..packing import PACKING_KEYS, install_packing
from ..packing import pipeline as packed_rows
from ..pipeline import SPLIT_BACKWARD
from ..pipeline.batches import PipelineBatches
from ..plan.apply import apply_checked_plan
from ..state import find_state, parallel_state
from ..styles.sequence_parallel import enter_sequence_region_at
from ..tensor_parallel.random import share_rng_states
from .compile import compile_blocks
from .data_parallel import DataParallelConfig, apply_data_parallel
from .full_model import install_save_pretrained
from .lazy_optimizer import build_lazy_optimizer, is_lazy_optimizer
from .materialize import materialize_lazy_model, move_to_device
from .optimizer import rebuild_optimizer, shard_states_in_place
from .parameters import keep_original_parameters
from .replicas import install_replica_watch
from .request import CheckedRequest
from .rng import install_split_regions
from .shared_batch import install_shared_batch

ParamMap = dict[int, nn.Parameter | None]  # {id(original parameter): parallel parameter, or None on another stage}


def compose_model(model: nn.Module, mesh: ParallelMesh, checked: CheckedRequest) -> ParamMap:
    """Steps 1-4 of a validated request: make `model` tensor/sequence-, expert-, context- and pipeline-parallel in
    place; return {id(original parameter): parallel parameter, or None on another stage} for the optimizer."""
    request, pipeline, checked_plan = checked.request, checked.pipeline, checked.targets
    originals = {id(p): p for p in model.parameters()}
    mapping: ParamMap = dict(originals)
    # 1. TP/SP on the whole model first: every rank resolves and checks the same plan, tied weights stay tied. The
    #    layers' modes follow from the whole request (schedules that defer weight gradients turn the overlap off).
    sequence = None
    if checked_plan is not None:
        overlap = pipeline is None or pipeline.schedule not in SPLIT_BACKWARD
        applied = apply_checked_plan(model, checked_plan, mesh, overlap=overlap)
        mapping.update(applied.param_map)
        sequence = applied.sequence
    if checked.after_plan is not None:  # family fix-ups of module attributes (local head counts, config views)
        checked.after_plan(model, mesh)
    # 1b. Expert parallelism: the experts split along the expert dim over the ep ranks sharing the dense weights,
    #     tokens dispatched to them by all-to-all (after the plan, so under tp each rank splits its tp slices).
    ep, state = mesh.size("ep"), find_state(model)
    if ep > 1 and (state is None or state.expert_parallel is None):
        moved = apply_expert_parallel(model, mesh.expert_group, ep, mesh.rank("ep"))
        mapping = {k: (moved.get(id(v), v) if v is not None else None) for k, v in mapping.items()}
    # The caller's parameter objects hold their shards: an optimizer built before this call steps the parallel model.
    mapping = keep_original_parameters(model, originals, mapping)
    # Random numbers: the tp ranks share the default streams (replicated work draws the same masks), split work
    #    draws from streams of its own per rank (tensor_parallel/random.py).
    if checked_plan is not None and mesh.size("tp") > 1:
        share_rng_states(mesh.tp_group)
        install_split_regions(model, applied.layers, mesh.rank("tp"))
    # 1c. Packed rows (several documents per row, told apart by restarting position ids, cu_seq_lens or seq_idx):
    #     without cp or pp a forward pre-hook puts them in the form the model's own mask builders turn into a
    #     document mask; cp's input split and the pipeline's batch functions (below) read that form themselves.
    state = parallel_state(model)
    if mesh.size("cp") == 1 and pipeline is None and not state.packing:
        install_packing(model)
        state.packing = True
    # 2. Context parallelism: attention over the cp ring, each rank's forward cut to its chunks of the sequence
    #    (after the plan, so the loss it wraps is the vocab-parallel one; weights are not touched).
    if mesh.size("cp") > 1:
        apply_context_parallel(model, mesh.group("cp"), request.context_parallel)
    # 3. Pipeline split: the rank keeps its stages; the parameters of other stages map to None.
    if pipeline is not None:
        from ..pipeline.runtime import apply_pipeline  # torch's pipelining (and torch._dynamo) load only here

        if mesh.size("cp") > 1:  # the cut of the sequence (of packed rows too) and its layers' masks
            split, gather_logits, stage_inputs = pipeline_functions(model)
            cut = {"split": split, "gather_logits": gather_logits, "stage_inputs": stage_inputs}
        else:
            cut = {"stage_inputs": packed_rows.stage_inputs}
        batches = PipelineBatches(prepare=packed_rows.prepare, keys=PACKING_KEYS, **cut)
        stages = apply_pipeline(
            model,
            mesh,
            pipeline.split_spec,
            pipeline.num_microbatches,
            pipeline.schedule,
            batches=batches,
            sequence=sequence,
        ).stages
        if sequence is not None:  # each stage receives the whole sequence: its first layer splits it again
            for stage in stages:
                if not stage.is_first:  # stage 0's first layer splits already (the plan's SequenceParallelBegin)
                    enter_sequence_region_at(stage.layers[0], sequence)
        present = {id(p) for p in model.parameters()}
        mapping = {k: (v if id(v) in present else None) for k, v in mapping.items()}
    # 4. Materialise only now, so a lazily built model reads only this rank's slices of its own stages
    #    (no-op for a model built normally; read_checkpoint=False when a sharded checkpoint will overwrite it).
    materialize_lazy_model(model, request.device, read_checkpoint=request.read_checkpoint)
    if request.device is not None:
        move_to_device(model, request.device)
    # Compile each decoder block's forward (traced at its first call, so wrappers added after this -- FSDP2, DDP,
    #    adapters -- are what it sees); everything around the blocks stays eager.
    if checked.compile is not None:
        compile_blocks(model, checked.compile)
    # The habits a parallel model must not silently break: the ranks of a batch replica share one batch, and the
    #    copies of every replicated tensor stay equal (checked on a cadence; once per model).
    state = parallel_state(model)
    if not state.guarded:
        state.guarded = True
        install_shared_batch(model, mesh, request.shared_batch)
        install_replica_watch(model, mesh)
        install_save_pretrained(model)  # the whole model, as one device would write it
    return mapping


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
    model: nn.Module, optimizer: torch.optim.Optimizer | None, mesh: ParallelMesh, checked: CheckedRequest
) -> tuple[nn.Module, torch.optim.Optimizer | None, ParamMap]:
    """Every step in order, for a request `validate` accepted; returns (model, optimizer, parameter map)."""
    mapping = compose_model(model, mesh, checked)
    model, optimizer = compose_training(model, optimizer, mesh, mapping, checked.data_parallel)
    return model, optimizer, mapping


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
