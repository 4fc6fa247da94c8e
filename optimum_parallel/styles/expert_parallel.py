"""Declare a custom model's experts module for expert parallelism (ep): which of its tensors hold one slice per
expert along dim 0. transformers' stacked experts are found by their shape without it."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..expert_parallel import ExpertsDeclaration, check_experts_divide, check_routed_forward, declare_experts
from .base import ParallelStyle


class ExpertParallel(ParallelStyle):
    """Mark the module as a stacked-experts module whose `tensors` (its own parameters: weights and their biases)
    hold the experts along dim 0; `num_experts`: the module's attribute counting its experts, if it has one (it is
    set to the local count once split). Under ep each rank keeps `experts / ep` consecutive experts of every tensor.

    The module's forward is transformers' experts contract: `forward(hidden_states [rows, hidden], top_k_index
    [rows, k], top_k_weights [rows, k])` returning the top-k weighted sum of the experts' outputs [rows, hidden];
    under ep it is called on the rows dispatched to this rank, with indices of its local experts. Composes with
    `TensorParallelExperts` on the same module (listed before it).
    """

    def __init__(self, tensors: Sequence[str] = ("gate_up_proj", "down_proj"), num_experts: str | None = None) -> None:
        if isinstance(tensors, str) or not tensors:
            raise ValueError(f"ExpertParallel(tensors={tensors!r}): allowed: a non-empty sequence of parameter names")
        self.tensors, self.num_experts = tuple(tensors), num_experts

    def declaration(self) -> ExpertsDeclaration:
        return ExpertsDeclaration(self.tensors, self.num_experts)

    def check(self, module, name, ctx):
        super().check(module, name, ctx)
        own = sorted(n for n, p in module._parameters.items() if p is not None)
        counts = {}
        for tensor in self.tensors:
            param = module._parameters.get(tensor)
            if not isinstance(param, nn.Parameter) or param.dim() == 0:
                raise ValueError(
                    f"ExpertParallel on {name!r}: {tensor!r} is not one of its parameters with an expert dim; "
                    f"allowed: its own parameters {own}"
                )
            counts[tensor] = param.shape[0]
        if len(set(counts.values())) > 1:
            raise ValueError(f"ExpertParallel on {name!r}: the tensors disagree on the number of experts: {counts}")
        count = next(iter(counts.values()))
        if self.num_experts is not None and getattr(module, self.num_experts, None) != count:
            raise ValueError(
                f"ExpertParallel on {name!r}: num_experts={self.num_experts!r} names no attribute equal to the "
                f"{count} experts of {self.tensors}; allowed: an int attribute of the module, or None"
            )
        check_experts_divide(count, ctx.mesh.size("ep"), name)
        check_routed_forward(module, name)

    def apply(self, module, name, ctx):
        declare_experts(module, self.declaration())
        return module
