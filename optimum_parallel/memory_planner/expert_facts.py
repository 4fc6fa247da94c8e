"""What the memory planner needs to know about a mixture-of-experts model: which parameters are expert tensors
(split over ep ranks on top of tp), how many experts each block has, and the rows expert parallelism's dispatch
keeps per MoE layer. Which ep the engine runs (dividing dp x cp and every block's experts) is the engine's check."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..expert_parallel import expert_count, expert_tensors, find_experts


@dataclass(frozen=True)
class ExpertFacts:
    """The stacked-experts modules of a model: their expert tensors' names, expert counts and routing top-k."""

    names: frozenset[str]  # parameter names of expert tensors (dim 0: one slice per expert)
    counts: tuple[int, ...]  # experts per MoE block
    top_k: int

    @classmethod
    def of(cls, model: nn.Module) -> ExpertFacts:
        names, counts = set(), []
        for module_name, module in find_experts(model):
            counts.append(expert_count(module))
            names |= {f"{module_name}.{leaf}" for leaf, _ in expert_tensors(module)}
        config = getattr(model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        top_k = int(getattr(text, "num_experts_per_tok", None) or getattr(text, "top_k", None) or 1)
        return cls(frozenset(names), tuple(counts), top_k)

    @property
    def moe_layers(self) -> int:
        return len(self.counts)


def dispatch_layer_bytes(s: int, b: int, h: int, top_k: int, element: int) -> float:
    """Bytes expert parallelism's dispatch keeps per MoE layer and micro-batch for the backward: the k routed copies
    of the rank's s x b tokens received by its experts and their outputs coming back, 2 sbkh (balanced routing;
    under skewed routing the busiest rank receives more)."""
    return 2 * s * b * top_k * h * element
