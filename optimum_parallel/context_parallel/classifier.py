"""A sequence classifier under context parallelism: transformers' `*ForSequenceClassification` scores every position
with its head (`score`) and keeps, for each row, the score of its last token that is not the pad token
(`pooled_positions`), which one cp rank holds.

The input split records each row's pooled position from the whole token ids; a forward hook on the head takes that
position's scores on the rank holding it and sums them over cp, and hands them back at every position of the rank's
chunks, so the model's own pooling (which reads a position of the local chunks) returns the one-device logits
(batch, num_labels) on every cp rank. The backward passes cp x the gradient to the holding rank: data parallelism
averages the gradients over dp x cp, as for the cp loss (`loss.py`). A classifier's labels are per row: they stay
whole, and its loss, computed from whole logits on every cp rank, needs no sum over cp.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from .loss import _SumOverContext


def classifier_head(model: nn.Module) -> nn.Module | None:
    """The head of a text sequence classifier (transformers' `*ForSequenceClassification`: `score`, no LM head), None
    for any other model."""
    if not type(model).__name__.endswith("ForSequenceClassification") or hasattr(model, "lm_head"):
        return None
    if getattr(getattr(model, "config", None), "vision_config", None) is not None:
        return None  # an image-text model merges its images before the sequence is cut: not handled here
    head = getattr(model, "score", None)
    return head if isinstance(head, nn.Linear) else None


def pooled_positions(model: nn.Module, input_ids: torch.Tensor | None, batch: int, length: int, device) -> torch.Tensor:
    """(batch,) the position transformers' sequence-classification pooling reads in each row of `length` tokens: the
    rightmost token that is not the pad token; the last one without a pad token or token ids."""
    pad = model.config.get_text_config().pad_token_id
    if input_ids is None or pad is None:
        return torch.full((batch,), length - 1, dtype=torch.long, device=device)
    real = (input_ids != pad).to(device, torch.int32)
    return (torch.arange(length, device=device, dtype=torch.int32) * real).argmax(-1)


class PooledScores:
    """The forward hook on a classifier's head under cp (see the module docstring); `record` is called by the input
    split with the whole batch and the layout of this rank's tokens, before the forward."""

    def __init__(self, model: nn.Module, group: ProcessGroup) -> None:
        self.model, self.group = model, group
        self.picked: torch.Tensor | None = None  # (batch, local tokens): the pooled position of each row

    def record(self, inputs: dict, layout) -> None:
        ids = inputs.get("input_ids")
        tokens = ids if ids is not None else inputs["inputs_embeds"]
        batch, length = tokens.shape[:2]
        positions = pooled_positions(self.model, ids, batch, length, tokens.device)
        mine = layout.take(torch.arange(layout.length, device=tokens.device), dim=0)
        self.picked = mine[None, :] == positions[:, None]

    def __call__(self, head: nn.Module, args: tuple, scores: torch.Tensor) -> torch.Tensor | None:
        picked, self.picked = self.picked, None
        if picked is None:  # outside the model's forward (a pipeline's last stage): every position's scores as they are
            return None
        mine = torch.where(picked[..., None], scores, torch.zeros((), dtype=scores.dtype, device=scores.device))
        pooled = _SumOverContext.apply(mine.sum(1), self.group)
        return pooled[:, None, :].expand_as(scores)
