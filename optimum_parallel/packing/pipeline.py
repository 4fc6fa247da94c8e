"""Packed rows through a pipeline: the batch functions the engine hands it (`pipeline.batches.PipelineBatches`).

`prepare` puts a packed batch in the packed form (`documents.pack`) and, when its rows do not divide into the
micro-batches (a padding-free batch is one row), lays its documents out in as many rows as there are micro-batches
(`rows.relay_rows`); what travels with the activations is then the (batch, 2, seq) *packed carrier*: the real-token
mask over the segment-encoded positions, from which every stage's layers take their positions (and, without
context parallelism, transformers its document mask). A batch that is not packed passes as it is."""

from __future__ import annotations

import torch

from .documents import PACKING_KEYS, pack
from .rows import relay_rows


def carrier(positions: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """The (batch, 2, seq) packed carrier: real-token mask (1, or 0 for padding a split added) and positions."""
    real = torch.ones_like(positions) if real is None else real.to(positions.dtype)
    return torch.stack([real, positions], dim=1)


def is_carrier(tensor: torch.Tensor | None) -> bool:
    """Whether what travels is a packed carrier (a padding mask is (batch, seq))."""
    return tensor is not None and tensor.dim() == 3


def prepare(input_ids, labels, attention_mask, microbatches: int, **extra):
    """(input_ids, labels, carrier, restore) of a whole batch (see the module docstring)."""
    if input_ids is None or not any(torch.is_tensor(extra.get(key)) for key in PACKING_KEYS):
        return input_ids, labels, attention_mask, None
    packed = pack({"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask, **extra})
    if packed is None:
        return input_ids, labels, attention_mask, None
    labels, positions, restore = packed.labels, packed.positions, None
    if input_ids.shape[0] % microbatches:
        relaid = relay_rows(input_ids, labels, positions, microbatches)
        input_ids, labels, positions, restore = relaid.input_ids, relaid.labels, relaid.positions, relaid.restore
    return input_ids, labels, carrier(positions), restore


def stage_inputs(travelling: torch.Tensor) -> dict:
    """A stage's mask and position arguments without context parallelism: the padding mask as it is, or a packed
    carrier's positions (and no mask: transformers builds the document mask from them)."""
    if is_carrier(travelling):
        return {"position_ids": travelling[:, 1]}
    return {"attention_mask": travelling}
