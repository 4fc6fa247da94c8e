"""How a whole batch becomes what this rank's stages run: three functions the engine hands the pipeline (identity
by default; context parallelism cuts the sequence there, see `context_parallel.pipeline_functions`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Split = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int | None],
]


def _whole(input_ids, labels, attention_mask):
    return input_ids, labels, attention_mask, None


@dataclass(frozen=True)
class PipelineBatches:
    """`split(input_ids, labels, attention_mask)`: this rank's part of a whole batch and the whole length (None when
    nothing was cut); `gather_logits(logits, length)`: the whole sequence's logits back from the ranks' parts;
    `stage_inputs(attention_mask)`: the mask (and position) arguments a stage's layers take."""

    split: Split = _whole
    gather_logits: Callable[[torch.Tensor, int], torch.Tensor] = lambda logits, length: logits
    stage_inputs: Callable[[torch.Tensor], dict] = lambda attention_mask: {"attention_mask": attention_mask}
