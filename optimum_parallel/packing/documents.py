"""Packed rows: several documents in one row, told apart by the batch itself. `pack` brings every way a batch marks
its documents (restarting `position_ids`, `cu_seq_lens_q` / `cu_seq_lens_k`, `seq_idx`) to one form, segment-encoded
positions with labels to match (`Packed`); `segment_ids` reads the segments back, and `packed_inputs` rewrites a
forward's kwargs to that form. Design notes: docs/module_notes.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100
CU_SEQ_LENS = ("cu_seq_lens_q", "cu_seq_lens_k")
FLASH_KEYS = (*CU_SEQ_LENS, "max_length_q", "max_length_k")
PACKING_KEYS = ("position_ids", *FLASH_KEYS, "seq_idx")  # the batch keys a packed batch may carry


@dataclass(frozen=True)
class Packed:
    """A packed batch in its one form: `positions` (batch, seq) segment-encoded, `labels` with every document's first
    token and every padding token ignored (None without labels)."""

    positions: torch.Tensor
    labels: torch.Tensor | None


def segment_ids(positions: torch.Tensor) -> torch.Tensor:
    """(batch, seq) int: the segment of every token, 0 for each row's first; a segment starts where a position is not
    the previous one plus one (as transformers' `find_packed_sequence_indices` reads packed position ids)."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return starts.long().cumsum(-1) - 1


def restarts(positions: torch.Tensor) -> bool:
    """Whether some row holds more than one segment."""
    return positions.shape[-1] > 1 and not bool((positions[:, 1:] == positions[:, :-1] + 1).all())


def _starts_from_cu_seq_lens(cu_seq_lens: torch.Tensor, batch: int, length: int, key: str) -> torch.Tensor:
    """(batch, seq) bool: the documents' first tokens, from cumulative lengths over the flattened batch."""
    cu = cu_seq_lens.reshape(-1).long().cpu()
    total = batch * length
    if cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != total or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(
            f"{key} must count up from 0 to the batch's {total} tokens (batch {batch} x seq {length}); got "
            f"{cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''}"
        )
    flat = torch.zeros(total, dtype=torch.bool)
    flat[cu[:-1][cu[:-1] < cu[1:]]] = True  # empty documents start nothing
    starts = flat.view(batch, length)
    starts[:, 0] = True
    return starts


def _starts(batch: dict, rows: int, length: int, device) -> tuple[torch.Tensor | None, str | None]:
    """The documents' first tokens as the batch marks them (None: one document per row as far as it says), and the
    key that marked them."""
    for key in CU_SEQ_LENS:
        if torch.is_tensor(batch.get(key)):
            return _starts_from_cu_seq_lens(batch[key], rows, length, key).to(device), key
    seq_idx = batch.get("seq_idx")
    if torch.is_tensor(seq_idx):
        seq_idx = seq_idx.reshape(rows, length).to(device)
        starts = torch.ones(rows, length, dtype=torch.bool, device=device)
        starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
        return starts, "seq_idx"
    positions = batch.get("position_ids")
    if torch.is_tensor(positions) and positions.dim() == 2:
        positions = positions.expand(rows, length).to(device)
        starts = torch.ones(rows, length, dtype=torch.bool, device=device)
        starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
        return starts, "position_ids"
    return None, None


def pack(batch: dict) -> Packed | None:
    """The packed form of `batch` (input_ids or inputs_embeds, optional attention_mask, labels, position_ids,
    cu_seq_lens_q/k, seq_idx), or None when no row holds two documents (then nothing changes)."""
    tokens = batch.get("input_ids")
    if tokens is None:
        tokens = batch.get("inputs_embeds")
    if tokens is None:
        return None
    rows, length = tokens.shape[:2]
    device = tokens.device
    starts, key = _starts(batch, rows, length, device)
    if starts is None:
        return None
    mask = batch.get("attention_mask")
    real = torch.ones(rows, length, dtype=torch.bool, device=device) if mask is None else mask.to(device).bool()
    if real.dim() != 2 or real.shape[-1] != length:
        return None  # a 4-D mask is the caller's own, a longer one covers cached keys: left as they are
    after_padding = torch.zeros_like(real)
    after_padding[:, 1:] = ~real[:, :-1]
    starts = (starts | after_padding) & real
    if not bool((starts.sum(-1) > 1).any()):
        return None
    positions = batch.get("position_ids")
    if positions is None:
        first = torch.arange(length, device=device).expand(rows, length)
        first = torch.cummax(torch.where(starts, first, torch.zeros_like(first)), dim=-1).values
        positions = torch.arange(length, device=device) - first
    else:
        positions = positions.expand(rows, length).to(device).long()
        previous_real = torch.zeros_like(real)
        previous_real[:, 1:] = real[:, :-1]
        counts = torch.zeros_like(real)
        counts[:, 1:] = positions[:, 1:] == positions[:, :-1] + 1
        inside = real & ~starts
        if bool((inside & ~counts).any()) or bool((starts & previous_real & counts).any()):
            raise ValueError(
                f"position_ids must start again at every document {key} marks and count up by one inside it; they "
                "do not here. Pass position_ids that restart at each document (or leave them out: they are then "
                "counted from 0 in every document)"
            )
    positions = _isolate_padding(positions.clone(), real)
    labels = batch.get("labels")
    if labels is not None:
        labels = labels.masked_fill(starts | ~real.to(labels.device), IGNORE_INDEX)
    return Packed(positions, labels)


def _isolate_padding(positions: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Give every run of padding tokens one value v such that each of its tokens is a segment of its own (v, v, ...)
    and neither the token before nor the one after joins it: v is not (position before) + 1 nor (position after) - 1."""
    if bool(real.all()):
        return positions
    for row in range(positions.shape[0]):
        pads = (~real[row]).nonzero().flatten().tolist()
        runs: list[list[int]] = []
        for index in pads:
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        values = positions[row].tolist()
        for run in runs:
            before = values[run[0] - 1] + 1 if run[0] > 0 else None
            after = values[run[-1] + 1] - 1 if run[-1] + 1 < len(values) else None
            value = next(v for v in (0, 2, 3) if v not in (before, after))
            positions[row, run[0] : run[-1] + 1] = value
    return positions


def packed_inputs(kwargs: dict, keep_flash_keys: bool = False) -> dict | None:
    """`kwargs` of a model forward in the packed form (docs/module_notes.md), or None when they are not packed
    or carry a key/value cache (decoding is not packing)."""
    if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:  # transformers 5 says `cache`
        return None
    packed = pack(kwargs)
    if packed is None:
        return None
    out = {k: v for k, v in kwargs.items() if keep_flash_keys or k not in (*FLASH_KEYS, "seq_idx")}
    out["position_ids"] = packed.positions
    out["attention_mask"] = None
    out["use_cache"] = False
    if packed.labels is not None:
        out["labels"] = packed.labels
    return out
