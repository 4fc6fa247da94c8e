"""What the planner counts per pipeline stage (local parameter numel, dense and expert, and tensors), and the
per-rank bytes of parameters, gradients and AdamW state those give at a sharding level: the dense tensors split
over the sharding group, the experts (under ep) over the dp x cp / ep ranks holding the same experts, as the engine
shards them (`data_parallel/levels.py`, `data_parallel/experts.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from .workload import Layout, Workload


@dataclass
class StageCounts:
    """Local parameter numel per pipeline stage (max over tp ranks), of which the expert tensors' (a block of
    num_experts / ep each), the parameter tensors per stage, and the largest layer's local numel."""

    per_stage: list[int]
    largest_layer: int
    param_tensors: list[int]  # parameter tensors per stage (AdamW keeps one step counter per tensor)
    experts: int = 0  # of which expert tensors' numel, on the rank with the most (all its stages)
    expert_stage: list[int] | None = None  # expert tensors' local numel per stage (max over tp ranks)
    expert_tensors: list[int] | None = None  # expert tensors per stage

    def split(self, stage: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """((dense numel, dense tensors), (expert numel, expert tensors)) of `stage`."""
        experts = (self.expert_stage or [0] * len(self.per_stage))[stage]
        tensors = (self.expert_tensors or [0] * len(self.per_stage))[stage]
        return (self.per_stage[stage] - experts, self.param_tensors[stage] - tensors), (experts, tensors)


def state_bytes(counts: StageCounts, layout: Layout, workload: Workload, level: int) -> tuple[float, float, float]:
    """(parameters, gradients, AdamW state) bytes of the stage holding the most of each: the dense tensors' divided by
    the sharding group at the levels that shard them (3: parameters, 2+: gradients, 1+: AdamW state), the experts'
    (under ep) by the dp x cp / ep ranks holding the same experts. AdamW's step counter (4 bytes per tensor) is
    divided alike (FSDP2 keeps one per tensor on every rank: a few bytes more)."""
    e, k = workload.element, workload.optimizer_bytes_per_param
    groups = (layout.sharding_group, layout.expert_replicas if layout.ep > 1 else layout.sharding_group)
    params = grads = state = 0.0
    for stage in range(layout.pp):
        parts = list(zip(counts.split(stage), groups, strict=True))
        params = max(params, sum(n * e / (g if level >= 3 else 1) for (n, _), g in parts))
        grads = max(grads, sum(n * e / (g if level >= 2 else 1) for (n, _), g in parts))
        state = max(state, sum((n * k + 4 * t) / (g if level >= 1 else 1) for (n, t), g in parts))
    return params, grads, state
