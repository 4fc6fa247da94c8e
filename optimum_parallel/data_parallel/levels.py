"""Data parallelism over the ranks that hold the same parameters (the mesh's dp x cp ranks), at Paddle's sharding
levels 0-3 (DDP, ZeRO-1, FSDP2), with hybrid sharding and a size threshold, on torch's own machinery:
`DataParallelConfig` and `apply_data_parallel`. Design notes: docs/module_notes.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..context_parallel import mark_gradients_reduced
from ..expert_parallel import expert_layout
from ..mesh import ParallelMesh
from ..mesh import device as devices
from ..plan.wrappers import plan_root
from ..state import find_state, parallel_state
from .gradient_sync import average_after_backward, stage_gradient_averager
from .zero_fsdp import below_threshold, fully_shard_model, replicate_model, zero1


@dataclass
class DataParallelConfig:
    """`dp_config`: sharding_level 0-3; reduce_dtype e.g. torch.float32 to reduce bf16 gradients in fp32 (FSDP);
    shard_size: ranks per sharding group (-1: all dp x cp ranks), replicated across groups (HSDP, levels 1-3);
    threshold: KB below which a parameter (this rank's tensor-parallel piece) stays whole on every rank (levels 2-3;
    ZeRO-1 at level 1 never cuts a tensor: it places each parameter's whole state on one rank of the group).
    Plain data: the request's validation checks it (`engine/checks.py`'s `check_data_parallel_config`)."""

    sharding_level: int = 0
    reduce_dtype: torch.dtype | None = None
    shard_size: int = -1
    threshold: float = 0


def apply_data_parallel(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    mesh: ParallelMesh,
    config: DataParallelConfig,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Make `model` (already tensor-parallel, or not) data-parallel over `mesh`'s dp x cp ranks; rebuild `optimizer`.
    Nothing to do when dp x cp is 1."""
    if mesh.data_parallel_size == 1:
        return model, optimizer
    mark_gradients_reduced(model)
    parallel_state(plan_root(model)).data_parallel_level = config.sharding_level
    # Under pp the schedule calls the stage modules, not the model: the stages are the wrapped roots.
    pipeline = parallel_state(plan_root(model)).pipeline
    roots = list(pipeline.stages) if pipeline is not None else [model]
    if pipeline is not None:  # the loss counts every dp replica's tokens; levels 0-1: the pipeline averages itself
        pipeline.replicas_group = mesh.group("batch") if mesh.size("batch") > 1 else None
        if config.sharding_level <= 1:  # experts: over their replica group (experts.py)
            dense = lambda p: expert_layout(p) is None  # noqa: E731
            pipeline.reduce_gradients = stage_gradient_averager(mesh.data_parallel_group, dense)
    state = find_state(model)
    if state is not None and state.expert_parallel is not None:  # experts reduce over their replica group only
        from .experts import apply_expert_data_parallel

        return apply_expert_data_parallel(
            model,
            optimizer,
            mesh,
            config.sharding_level,
            state.expert_parallel,
            roots,
            config.reduce_dtype,
            config.threshold,
        )
    if config.sharding_level == 0 and devices.is_graph_device(mesh.device_type):
        # composable DDP does not run here: at the first forward it builds its reducer with collectives of its own
        # (tried with torch-xla 2.9 on two devices of one process: their all-gathers never meet and XLA ends the
        # process); one flat all-reduce per backward instead, in the step's graph, the same graph on every rank
        average_after_backward(list(model.parameters()), mesh.data_parallel_group)
        return model, optimizer
    if config.sharding_level <= 1:
        if pipeline is None:
            replicate_model(model, mesh.data_parallel_group)
        if optimizer is not None and config.sharding_level == 1:
            optimizer = zero1(optimizer, mesh.sharding_group(config.shard_size))
        return model, optimizer

    dp_mesh = mesh.sharding_mesh(config.shard_size)  # 1-D: FSDP; 2-D (replicate, shard): HSDP
    small = below_threshold(model, config.threshold)
    return fully_shard_model(
        model, optimizer, roots, dp_mesh, config.sharding_level, config.reduce_dtype, small, mesh.data_parallel_group
    )
