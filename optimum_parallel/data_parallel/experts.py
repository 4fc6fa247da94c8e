"""Data parallelism for an expert-parallel model (`apply_expert_data_parallel`): the dense parameters over dp x cp as
usual, the experts only over their replica group (the dp x cp / ep ranks holding the same experts), scaled so that
each expert's gradient is the mean over dp x cp (`reduce_expert_gradients`). Design notes: docs/module_notes.md.
"""

from __future__ import annotations

import torch
from torch import nn

from ..expert_parallel import ExpertParallelRuntime, find_experts
from ..mesh import ParallelMesh, ranks
from .expert_optimizer import ExpertSplitOptimizer
from .gradient_sync import average_flat
from .zero_fsdp import below_threshold, fully_shard_model, replicate_model, zero1


def apply_expert_data_parallel(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    mesh: ParallelMesh,
    level: int,
    runtime: ExpertParallelRuntime,
    roots: list[nn.Module],
    reduce_dtype: torch.dtype | None = None,
    threshold: float = 0,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Make the expert-parallel `model` data-parallel at sharding `level` over `mesh`; rebuild `optimizer`.
    `roots`: the modules the forward calls (the model, or under pp its stages), which FSDP2 wraps."""
    experts = [module for _, module in find_experts(model)]
    if level <= 1:
        reduce_expert_gradients(experts, runtime, mesh)
        if len(roots) == 1 and roots[0] is model:  # under pp the pipeline all-reduces the dense gradients itself
            replicate_model(model, mesh.data_parallel_group, experts)
        if optimizer is not None and level == 1:
            optimizer = _split_zero1(optimizer, experts, mesh)
        return model, optimizer
    return _fully_shard(model, optimizer, mesh, level, runtime, roots, experts, reduce_dtype, threshold)


def reduce_expert_gradients(experts: list[nn.Module], runtime: ExpertParallelRuntime, mesh: ParallelMesh) -> None:
    """DDP semantics for the expert parameters: each expert's gradient becomes the mean over dp x cp of the replicas'
    gradients. A rank's raw expert gradient sums its expert group's tokens, so it is scaled by 1/ep as it arrives
    (before accumulation) and then averaged over the ranks holding the same experts (dp x cp / ep of them), once per
    backward, in one bucket; averaging replicated values changes nothing, so it stays right when gradients accumulate
    over micro-batches. The dispatch backward queues it, so it runs on every rank even where no token reached this
    rank's experts (their gradients are then zeros)."""
    params = [p for module in experts for p in module.parameters(recurse=False) if p.requires_grad]
    scale = 1.0 / runtime.ep
    for param in params:
        param.register_hook(lambda grad: grad * scale)
    for param in params:  # a compiled block's dispatch cannot queue it from its backward: the gradients do
        param.register_post_accumulate_grad_hook(lambda _param: runtime.backward_started())
    group = mesh.expert_replica_group
    runtime.after_backward.append(lambda: average_flat(params, group, fill_missing=True))
    runtime.gradients_reduced = True


def _split_zero1(
    optimizer: torch.optim.Optimizer, experts: list[nn.Module], mesh: ParallelMesh
) -> torch.optim.Optimizer:
    expert_ids = {id(p) for module in experts for p in module.parameters(recurse=False)}
    dense, local = [], []
    for group in optimizer.param_groups:
        options = {k: v for k, v in group.items() if k != "params"}
        dense.append({**options, "params": [p for p in group["params"] if id(p) not in expert_ids]})
        local.append({**options, "params": [p for p in group["params"] if id(p) in expert_ids]})
    parts, origins = [], []
    for groups, group in ((dense, mesh.data_parallel_group), (local, mesh.expert_replica_group)):
        kept = [i for i, g in enumerate(groups) if g["params"]]
        if kept:
            parts.append(zero1(optimizer, group, [groups[i] for i in kept]))
            origins.append(kept)
    return ExpertSplitOptimizer(parts, origins, [dict(g) for g in optimizer.param_groups])


def _fully_shard(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    mesh: ParallelMesh,
    level: int,
    runtime: ExpertParallelRuntime,
    roots: list[nn.Module],
    experts: list[nn.Module],
    reduce_dtype: torch.dtype | None,
    threshold: float,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """FSDP2: the experts modules first (on the replica sub-mesh), then each block and each root on dp x cp."""
    from torch.distributed.fsdp import fully_shard

    def shard_experts(reshard: bool, policy) -> None:
        for module in experts:
            fully_shard(module, mesh=mesh.expert_replica_mesh, reshard_after_forward=reshard, mp_policy=policy)
            module.set_gradient_divide_factor(float(mesh.data_parallel_size))
            if ranks.world_size(mesh.expert_replica_group) > 1:  # one rank: torch divides once without, twice with
                module.set_force_sum_reduction_for_comms(True)

    expert_ids = {id(p) for module in experts for p in module.parameters(recurse=False)}
    small = [p for p in below_threshold(model, threshold) if id(p) not in expert_ids]
    runtime.gradients_reduced = True
    return fully_shard_model(
        model,
        optimizer,
        roots,
        mesh.data_parallel_mesh,
        level,
        reduce_dtype,
        small,
        mesh.data_parallel_group,
        shard_experts,
    )
