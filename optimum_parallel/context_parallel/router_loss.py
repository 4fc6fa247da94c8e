"""The router load-balancing loss under context parallelism: one device's on the replica's whole rows.

transformers' `load_balancing_loss_func` is E x sum_e f_e x P_e over the real tokens of every MoE layer: f_e the share
of top-k assignments that go to expert e, P_e the mean router probability of e. Both are token means, which a cp
rank's chunks alone do not give, and the model's own computation would read the whole sequence's padding mask against
a rank's chunks. So the model runs with `output_router_logits=False`; forward hooks on each MoE block's `gate` keep
its router logits, and after the forward each rank sums its real tokens' assignments and probabilities, the sums are
added over cp (the probabilities' with the cp loss's backward scale, so that data parallelism's average over dp x cp
gives the single-device gradient) and every rank adds coef x the same loss to its (already whole) loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from .loss import _SumOverContext


@dataclass
class RouterLoss:
    """Per model: the routers' logits of the current forward and which of the rank's rows are real tokens."""

    group: ProcessGroup
    routers: int = 0  # MoE blocks found
    logits: list[torch.Tensor] = field(default_factory=list)
    mask: torch.Tensor | None = None  # (rows,) bool; None outside a forward that asked for the aux loss
    labels: bool = False  # whether that forward computes a loss


def routers(model: nn.Module) -> list[nn.Module]:
    """The router of every MoE block: a block's `gate` next to its `experts` (transformers' MoE blocks)."""
    return [
        m.gate for m in model.modules() if isinstance(getattr(m, "gate", None), nn.Module) and hasattr(m, "experts")
    ]


def install_router_loss(model: nn.Module, group: ProcessGroup) -> RouterLoss:
    found = routers(model)
    router_loss = RouterLoss(group, len(found))

    def keep(module, args, output) -> None:
        if router_loss.mask is not None:  # not in an activation-checkpoint recompute (after the forward)
            router_loss.logits.append(output[0] if isinstance(output, tuple) else output)

    for router in found:
        router.register_forward_hook(keep)
    return router_loss


def wants_router_logits(model: nn.Module, router_loss: RouterLoss, requested: object) -> bool:
    """Whether this forward of a MoE model asks for the aux loss (its argument, else the config's)."""
    if requested is None:
        requested = getattr(model.config, "output_router_logits", False)
    return bool(requested) and router_loss.routers > 0


def add_router_loss(model: nn.Module, router_loss: RouterLoss, output):
    """Set `output.aux_loss` (and `router_logits`: this rank's rows) and add coef x the aux loss to `output.loss`."""
    mask, logits = router_loss.mask, router_loss.logits
    router_loss.mask, router_loss.logits = None, []
    experts = model.num_experts
    top_k = model.num_experts_per_tok
    weight = mask.float()
    assigned = torch.zeros(experts, dtype=torch.float32, device=weight.device)
    probability = torch.zeros(experts, dtype=torch.float32, device=weight.device)
    for layer in logits:
        probs = torch.softmax(layer.float(), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        assigned = assigned.scatter_add(0, chosen.reshape(-1), weight.repeat_interleave(top_k))
        probability = probability + (probs * weight[:, None]).sum(0)
    counts = torch.stack([assigned, weight.sum().expand(experts) * len(logits)]).detach()
    dist.all_reduce(counts, group=router_loss.group)
    probability = _SumOverContext.apply(probability, router_loss.group)
    aux = experts * torch.sum(counts[0] / counts[1] * probability / counts[1])
    output.aux_loss, output.router_logits = aux, tuple(logits)
    if router_loss.labels and output.loss is not None:
        output.loss = output.loss + model.router_aux_loss_coef * aux.to(output.loss.device)
    return output
