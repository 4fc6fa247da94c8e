"""Step 0 of the composition: every check that can run before anything changes, in one place.

A bad request raises ONE error, naming the key the caller used (`pp_config['schedule']` for `parallelize`,
`pipeline_parallel_schedule` for the Parallelizer, `pipeline_schedule` for the Trainer) and the allowed values, on
every rank (the checks read only what every rank holds alike), before any module or parameter is touched. The checks
themselves live with the steps they guard (`check_plan`, `check_pipeline`, `check_context_parallel`,
`check_data_parallel`), which also run them when called on their own: one check and one message each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..context_parallel import check_context_parallel
from ..expert_parallel import check_expert_parallel
from ..mesh import ParallelMesh
from ..pipeline import check_pipeline
from ..plan import check_plan
from ..state import find_state
from ..styles import ExpertParallel, ParallelStyle
from .data_parallel import DataParallelConfig, check_data_parallel
from .expert_data_parallel import check_expert_data_parallel

if TYPE_CHECKING:
    from .compose import PipelineRequest


@dataclass(frozen=True)
class RequestKeys:
    """What each front door calls the settings the checks name in their errors (default: the Parallelizer's)."""

    schedule: str = "pipeline_parallel_schedule"
    num_microbatches: str = "pipeline_parallel_num_microbatches"
    context_parallel: str = "context_parallel_strategy"
    sharding_level: str = "sharding_level"
    shard_size: str = "dp_config['shard_size']"


PARALLELIZER_KEYS = RequestKeys()
CONFIG_KEYS = RequestKeys(  # parallelize(model, optimizer, mesh, config)
    schedule="pp_config['schedule']",
    num_microbatches="pp_config['num_microbatches']",
    sharding_level="dp_config['sharding_level']",
)
TRAINER_KEYS = RequestKeys(schedule="pipeline_schedule", shard_size="shard_size")  # ParallelTrainingArguments


def validate_request(
    model: nn.Module,
    mesh: ParallelMesh,
    plan: Mapping[str, object] | None = None,
    *,
    pipeline: PipelineRequest | None = None,
    context_parallel: str = "ring",
    data_parallel: DataParallelConfig | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    keys: RequestKeys = PARALLELIZER_KEYS,
) -> dict[str, list[ParallelStyle]] | None:
    """Raise if any step of `compose` would refuse this request; change nothing. Return the plan as checked
    ({module name: styles}, what `apply_plan` then applies without checking it again; None without a plan).

    The plan (keys resolve, every style fits its module, adapters around planned layers can follow the split), the
    pipeline split and schedule, context-parallel support and strategy (cp > 1, unless the model is already
    context-parallel), and the data-parallel level with its optimizer.
    """
    targets = check_plan(model, plan, mesh) if plan else None
    if pipeline is not None:
        check_pipeline(
            model,
            mesh.size("pp"),
            pipeline.split_spec,
            pipeline.num_microbatches,
            pipeline.schedule,
            schedule_key=keys.schedule,
            microbatches_key=keys.num_microbatches,
        )
        check_router_logits(model, mesh.size("pp"))
    cp = mesh.size("cp")
    state = find_state(model)  # a read that records nothing: validation changes nothing
    if cp > 1 and (state is None or state.context_parallel is None):
        tp = mesh.size("tp") if plan else 1  # q/k/v are split over tp by the plan: all_to_all sees local heads
        check_context_parallel(model, cp, context_parallel, tp, keys.context_parallel)
    if data_parallel is not None:
        size = mesh.data_parallel_size
        check_data_parallel(data_parallel, optimizer, keys.sharding_level, size, mesh.device_type)
    ep = mesh.size("ep")
    if ep > 1 and (state is None or state.expert_parallel is None):
        declared = [
            name for name, styles in (targets or {}).items() if any(isinstance(s, ExpertParallel) for s in styles)
        ]
        check_expert_parallel(model, ep, declared=declared)
        if data_parallel is not None:
            check_expert_data_parallel(data_parallel.shard_size, ep, keys.shard_size)
    return targets


def check_router_logits(model: nn.Module, pp: int) -> None:
    """Under pp the stages pass hidden states only and the loss is the language-model one: a router aux loss
    (`output_router_logits=True`) would be dropped without a word, so it is refused."""
    config = getattr(model, "config", None)
    if pp > 1 and getattr(config, "output_router_logits", False):
        raise ValueError(
            f"output_router_logits=True with pp={pp} is not supported (the pipeline's loss has no router aux loss: "
            "the stages pass hidden states only); allowed with pp > 1: output_router_logits=False"
        )
