"""Expert parallelism: the experts of a mixture-of-experts model split over ranks that share the dense weights,
tokens dispatched to them by all-to-all (dispatch) and the split itself (experts)."""

from .dispatch import all_to_all_rows, exchange_counts
from .expert_split import (
    ExpertParallelRuntime,
    ExpertsDeclaration,
    apply_expert_parallel,
    check_expert_parallel,
    check_experts_divide,
    check_routed_forward,
    declare_experts,
    expert_count,
    expert_layout,
    expert_range,
    expert_tensors,
    find_experts,
    is_experts_module,
)

__all__ = [
    "ExpertParallelRuntime",
    "ExpertsDeclaration",
    "all_to_all_rows",
    "apply_expert_parallel",
    "check_expert_parallel",
    "check_experts_divide",
    "check_routed_forward",
    "declare_experts",
    "expert_count",
    "exchange_counts",
    "expert_layout",
    "expert_range",
    "expert_tensors",
    "find_experts",
    "is_experts_module",
]
