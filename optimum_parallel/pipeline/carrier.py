"""What travels with the hidden states from stage to stage (the carrier): named, batch-first tensors, the same names for
every micro-batch of a step. `StepCarrier` names one step's carrier; `LanguageInputs` carries the language model's
inputs that a vision-language model's entry computes on the first stage; `encode_positions` / `decode_positions` put
position ids batch-first and back; `deepstack_layers` counts Qwen3-VL's deepstack layers. Design notes:
docs/module_notes.md.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from .images import DealtImages

MASK, ROWS = "attention_mask", "rows"
POSITIONS, VISUAL, DEEPSTACK = "position_ids", "visual_pos_masks", "deepstack_visual_embeds"
LANGUAGE_INPUTS = (POSITIONS, VISUAL, DEEPSTACK)


@dataclass(frozen=True)
class StepCarrier:
    """One step's carrier: the batch's row-aligned model inputs (`row_keys`, in order) and its images dealt to the
    rows (None: none)."""

    row_keys: tuple[str, ...] = ()
    images: DealtImages | None = None

    def first_names(self) -> tuple[str, ...]:
        """The names of what the first stage takes after the token ids."""
        return (MASK, *self.row_keys, *((ROWS,) if self.images is not None else ()))

    def names_after(self, language: LanguageInputs | None, stage_index: int) -> tuple[str, ...]:
        """The names of what stage `stage_index` sends after the hidden states."""
        return (MASK, *self.row_keys, *(language.names_after(stage_index) if language is not None else ()))


def encode_positions(positions: torch.Tensor | None, rows: int) -> torch.Tensor:
    """Position ids batch-first: (k, batch, seq) -> (batch, k, seq); (batch, seq) as they are; None -> (rows, 0)."""
    if positions is None:
        return torch.zeros(rows, 0, dtype=torch.long)
    return positions.movedim(0, 1).contiguous() if positions.dim() == 3 else positions


def decode_positions(carried: torch.Tensor | None) -> torch.Tensor | None:
    """The inverse of `encode_positions`."""
    if carried is None or carried.numel() == 0:
        return None
    return carried.movedim(1, 0) if carried.dim() == 3 else carried


class LanguageInputs:
    """The language model's inputs a vision-language model's entry computes on the first stage, and how each stage
    gets its share: the M-RoPE positions travel to every stage; Qwen3-VL's deepstack features (added to the hidden
    states after layer i at the image positions, i < `deepstack`) travel, scattered along the sequence as
    (batch, layers, seq, hidden) with their (batch, seq) positions, while a later stage holds such a layer. A stage's
    language model takes the features of its own layers only (zeros for the layers before them, which other stages
    ran)."""

    def __init__(self, deepstack: int, stage_layers: list[range]) -> None:
        self.deepstack = deepstack
        self.stage_layers = stage_layers

    def _deepstack_after(self, stage_index: int) -> int:
        """How many deepstack layers lie after stage `stage_index`'s layers."""
        return max(0, self.deepstack - self.stage_layers[stage_index].stop)

    def names_after(self, stage_index: int) -> tuple[str, ...]:
        extra = (VISUAL, DEEPSTACK) if self._deepstack_after(stage_index) else ()
        return (POSITIONS, *extra)

    def first_stage(self, stage_index: int, captured: dict, kwargs: dict) -> dict:
        """The first stage's language model kwargs: the deepstack features of its own layers."""
        features = captured.get(DEEPSTACK)
        if features is None:
            return kwargs
        return {**kwargs, DEEPSTACK: list(features[: self.stage_layers[stage_index].stop])}

    def later_stage(self, stage_index: int, received: dict, kwargs: dict) -> dict:
        """A later stage's language model kwargs from what it received: positions, and the deepstack features of its
        own layers."""
        kwargs = {**kwargs, POSITIONS: decode_positions(received[POSITIONS])}
        dense = received.get(DEEPSTACK)
        if dense is None:
            return kwargs
        layers = self.stage_layers[stage_index]
        mask = received[VISUAL].bool()
        mine = [dense[:, i][mask] for i in range(min(self.deepstack, layers.stop) - layers.start)]
        before = [dense.new_zeros(int(mask.sum()), dense.shape[-1])] * layers.start
        return {**kwargs, VISUAL: mask, DEEPSTACK: before + mine}

    def send_first(self, stage_index: int, captured: dict, input_ids: torch.Tensor, hidden: torch.Tensor) -> tuple:
        """What the first stage sends on: positions, and the deepstack features of later layers scattered along the
        sequence (zeros, still taking gradients, for a micro-batch without images)."""
        rows, length = input_ids.shape
        out = [encode_positions(captured.get(POSITIONS), rows).to(input_ids.device)]
        after = self._deepstack_after(stage_index)
        if not after:
            return tuple(out)
        mask, features = captured.get(VISUAL), captured.get(DEEPSTACK)
        if mask is None or features is None:
            shape = (rows, after, length, hidden.shape[-1])
            dense = torch.zeros(shape, dtype=hidden.dtype, device=hidden.device, requires_grad=hidden.requires_grad)
            return (*out, torch.zeros_like(input_ids), dense)
        zeros = hidden.new_zeros(rows, length, hidden.shape[-1])
        start = self.stage_layers[stage_index].stop
        scattered = [  # a layer past the model's features gets none added, as on one device
            zeros.masked_scatter(mask[..., None], features[layer]) if layer < len(features) else zeros
            for layer in range(start, self.deepstack)
        ]
        return (*out, mask.long(), torch.stack(scattered, dim=1))

    def send_later(self, stage_index: int, received: dict) -> tuple:
        """What a later stage sends on: what it received, less the deepstack features of its own layers."""
        out = [received[POSITIONS]]
        after = self._deepstack_after(stage_index)
        if after:
            dense = received[DEEPSTACK]
            out += [received[VISUAL], dense[:, dense.shape[1] - after :].clone()]  # not a view: sent, then detached
        return tuple(out)


def deepstack_layers(model, base) -> int:
    """How many of the language model `base`'s first layers get deepstack features added (Qwen3-VL: one per vision
    layer its vision config's `deepstack_visual_indexes` names); 0 when its forward takes none."""
    if DEEPSTACK not in inspect.signature(type(base).forward).parameters:
        return 0
    indexes = getattr(getattr(model.config, "vision_config", None), "deepstack_visual_indexes", None)
    if not isinstance(indexes, (list, tuple)):
        raise NotImplementedError(
            f"pipeline parallelism: {type(base).__name__} adds deepstack features to its first layers, but "
            f"{type(model.config).__name__} names no vision_config.deepstack_visual_indexes to count them; allowed for "
            "this model: pp=1"
        )
    return len(indexes)
