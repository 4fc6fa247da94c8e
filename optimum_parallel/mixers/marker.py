"""What a mixer needs to know of the sequence it runs on, delivered the way transformers delivers its padding mask.

transformers gives every Mamba / delta-net / short-convolution layer the 2-D padding mask that
`masking_utils.create_recurrent_attention_mask` returns, called once per forward by the decoder. Under context
parallelism or packed rows, the decoder's module gets a version of that function returning a `SequenceMarker`
instead while a parallel forward runs (a forward pre-hook on the decoder sets it, its forward hook clears it): the
whole sequence's padding mask, the documents of packed rows, and under cp which tokens each rank holds. The marker
reaches each mixer as its `attention_mask` argument, so a forward recomputed under activation checkpointing sees the
same marker, and a mixer the runner does not wrap fails loudly on it instead of mixing documents silently.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from ..context_parallel.attention import is_marker, marked_documents
from ..context_parallel.load_balance import ChunkLayout
from ..packing import restarts, segment_ids

MASK_FUNCTION = "create_recurrent_attention_mask"
_CURRENT: contextvars.ContextVar[SequenceMarker | None] = contextvars.ContextVar(
    "optimum_parallel_marker", default=None
)


@dataclass
class SequenceMarker:
    """`real`: (batch, whole length) bool, the padding mask the mixer applies (None: no padding); `segments`:
    (batch, whole length) the document of every token of packed rows (None: one sequence per row); `layout`: which
    tokens every cp rank holds (None without cp). Derived index tensors are made once per forward (`cache`)."""

    real: torch.Tensor | None = None
    segments: torch.Tensor | None = None
    layout: object | None = None
    cache: dict = field(default_factory=dict, repr=False)

    def cached(self, key: str, make):
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]


def current_marker() -> SequenceMarker | None:
    """The marker of the decoder forward running now in this thread (None outside one, or in a plain forward)."""
    return _CURRENT.get()


def marker_for(kwargs: dict, cp: int | None, layout_rank: int | None) -> SequenceMarker | None:
    """The marker of a decoder forward called with `kwargs`: from the cp input split's mask (the whole sequence's
    padding, its documents and layout), else from packed position ids (their documents); None for a plain batch."""
    mask = kwargs.get("attention_mask")
    if is_marker(mask):
        real = mask[:, 0, 0, :]
        documents = marked_documents(mask)
        if documents is not None:
            return SequenceMarker(None, documents.segments, documents.layout)
        layout = ChunkLayout(cp, layout_rank, real.shape[-1]) if cp else None
        return SequenceMarker(None if bool(real.all()) else real, None, layout)
    positions = kwargs.get("position_ids")
    if torch.is_tensor(positions) and positions.dim() == 3:  # M-RoPE (sections or text, t, h, w): the text row
        positions = positions[0]
    if torch.is_tensor(positions) and positions.dim() == 2 and mask is None and restarts(positions):
        return SequenceMarker(None, segment_ids(positions), None)
    return None


def _enter(cp: int | None, layout_rank: int | None, module: nn.Module, args: tuple, kwargs: dict):
    tokens = module.__dict__.setdefault("_optimum_parallel_marker_tokens", [])
    tokens.append(_CURRENT.set(marker_for(kwargs, cp, layout_rank)))


def _leave(module: nn.Module, args: tuple, kwargs: dict, output):
    tokens = module.__dict__.get("_optimum_parallel_marker_tokens")
    if tokens:
        _CURRENT.reset(tokens.pop())


def _markers_or(original):
    @functools.wraps(original)
    def mask(*args, **kwargs):
        marker = _CURRENT.get()
        return marker if marker is not None else original(*args, **kwargs)

    mask._optimum_parallel_original = original
    return mask


def _namespace(decoder: nn.Module) -> dict:
    """The globals `decoder`'s forward looks names up in (its defining module's, under any decorators)."""
    return getattr(inspect.unwrap(type(decoder).forward), "__globals__", {})


def builds_recurrent_mask(decoder: nn.Module) -> bool:
    """Whether `decoder`'s forward builds its mixers' mask with transformers' `create_recurrent_attention_mask`."""
    return MASK_FUNCTION in _namespace(decoder)


def install_markers(decoder: nn.Module, cp: int | None = None, layout_rank: int | None = None) -> None:
    """Mark `decoder`'s forwards (once): the hooks that set and clear the running forward's marker, and its module's
    `create_recurrent_attention_mask` returning the marker while one is set (the function as it was otherwise)."""
    if decoder.__dict__.get("_optimum_parallel_markers"):
        return
    namespace = _namespace(decoder)
    original = namespace[MASK_FUNCTION]
    if not hasattr(original, "_optimum_parallel_original"):
        namespace[MASK_FUNCTION] = _markers_or(original)
    decoder.register_forward_pre_hook(functools.partial(_enter, cp, layout_rank), with_kwargs=True)
    decoder.register_forward_hook(_leave, with_kwargs=True, always_call=True)
    decoder.__dict__["_optimum_parallel_markers"] = True
