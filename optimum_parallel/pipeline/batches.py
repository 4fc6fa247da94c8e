"""How a whole batch becomes what this rank's stages run: the functions the engine hands the pipeline (identity by
default; packed rows are laid out for the micro-batches in `prepare`, context parallelism cuts the sequence in
`split`, see `packing.pipeline` and `context_parallel.pipeline_functions`).

What travels with the activations from stage to stage (the `carrier`) is whatever `prepare` / `split` make of the
attention mask: the (batch, seq) padding mask by default; the pipeline only passes it on, and `stage_inputs` turns it
into the layers' mask and position arguments."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..context_parallel import pipeline_functions
from ..packing import PACKING_KEYS
from ..packing import pipeline as packed_rows

Prepare = Callable[..., tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, Callable | None]]
Split = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor | None, int],
    tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, object],
]


def _as_given(input_ids, labels, attention_mask, microbatches, **extra):
    return input_ids, labels, attention_mask, None


def _whole(input_ids, labels, attention_mask, microbatches):
    return input_ids, labels, attention_mask, None


@dataclass(frozen=True)
class PipelineBatches:
    """`prepare(input_ids, labels, attention_mask, microbatches, **extra)`: the whole batch in rows the micro-batches
    split (the batch keys it takes beyond those three are `keys`), its carrier, and a function putting per-token
    outputs back in the caller's rows (None: they are in place); `split(input_ids, labels, carrier, microbatches)`:
    this rank's part of the prepared batch and what was cut (opaque here; None when nothing was);
    `gather_logits(logits, cut)`: the whole sequence's logits back from the ranks' parts; `stage_inputs(carrier)`:
    the mask (and position) arguments a stage's layers take."""

    prepare: Prepare = _as_given
    split: Split = _whole
    gather_logits: Callable[[torch.Tensor, object], torch.Tensor] = lambda logits, cut: logits
    stage_inputs: Callable[[torch.Tensor], dict] = lambda attention_mask: {"attention_mask": attention_mask}
    keys: tuple[str, ...] = ()


def stage_batches(model: nn.Module, context_parallel: bool) -> PipelineBatches:
    """The batch functions of `model`'s pipeline: packed rows laid out for the micro-batches (several documents per
    row stay apart), and under context parallelism the cut of the sequence (of packed rows too) and its layers'
    masks."""
    if context_parallel:
        split, gather_logits, stage_inputs = pipeline_functions(model)
        cut = {"split": split, "gather_logits": gather_logits, "stage_inputs": stage_inputs}
    else:
        cut = {"stage_inputs": packed_rows.stage_inputs}
    return PipelineBatches(prepare=packed_rows.prepare, keys=PACKING_KEYS, **cut)
