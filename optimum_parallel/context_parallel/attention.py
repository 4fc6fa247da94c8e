"""The attention function a context-parallel model runs, registered in transformers' `AttentionInterface`.

The model's attention modules call it with this rank's query / key / value chunks (already rotated by their
global positions) and, as `attention_mask`, the marker the input split made: (batch, 1, 1, seq) bool over the
whole sequence, True = a real token. transformers hands a 4-D mask to the layers untouched, so the causal,
padding and sliding-window masks are built here, pair of chunks by pair of chunks, from global positions.
The same function serves models loaded with eager or sdpa attention (both are exact softmax attention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from ..state import find_state
from .blocks import Attend, default_scale
from .layout import ChunkLayout
from .packed import Documents
from .ring import ring_attention
from .ulysses import all_to_all_attention

ATTENTION_KEY = "optimum_parallel_context"
STRATEGIES = ("ring", "all_to_all")


def check_strategy(strategy: object, key: str = "context_parallel_strategy") -> None:
    """`strategy` is one of `STRATEGIES`; the error names `key` (the caller's name for it) and the allowed ones."""
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ValueError(f"{key}={strategy!r} is not allowed; allowed: {', '.join(STRATEGIES)}")


_MARK = "_optimum_parallel_sequence_mask"
_DOCUMENTS = "_optimum_parallel_documents"


@dataclass(frozen=True)
class ContextParallelAttention:
    """Set on every attention module of a context-parallel model."""

    group: ProcessGroup
    layout_rank: int
    cp: int
    strategy: str


def sequence_mask(key_mask: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
    """The marker the layers receive as `attention_mask`: the whole sequence's (batch, seq) padding mask, and for a
    packed batch its documents and layout (packed.py)."""
    marker = key_mask.bool()[:, None, None, :]
    setattr(marker, _MARK, bool(key_mask.all()))
    setattr(marker, _DOCUMENTS, documents)
    return marker


def is_marker(attention_mask) -> bool:
    """Whether `attention_mask` is the marker the input split made (`sequence_mask`)."""
    return getattr(attention_mask, _MARK, None) is not None


def marked_documents(attention_mask) -> Documents | None:
    """The documents a marker carries (None: one sequence per row)."""
    return getattr(attention_mask, _DOCUMENTS, None)


def _read_mask(attention_mask) -> tuple[torch.Tensor | None, int]:
    every_token = getattr(attention_mask, _MARK, None)
    if every_token is None:
        raise ValueError(
            "a context-parallel attention layer got an attention mask its input split did not make: pass a 2-D "
            "(batch, seq) padding mask or none to the model; 4-D masks and key/value caches are not supported under "
            "context parallelism"
        )
    return (None if every_token else attention_mask[:, 0, 0, :]), attention_mask.shape[-1]


def context_parallel_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
):
    state = find_state(module)
    settings = state.context_parallel if state is not None else None
    if settings is None:
        raise RuntimeError(f"{type(module).__name__} was not set up for context parallelism")
    if dropout and module.training:
        raise NotImplementedError("attention dropout is not supported under context parallelism; set it to 0")
    if kwargs.get("s_aux") is not None:  # found before composing (engine/structure.py); a last guard, never silent
        raise NotImplementedError(
            f"{type(module).__name__}: attention sinks are not computed under context parallelism"
        )
    key_mask, length = _read_mask(attention_mask)
    documents = marked_documents(attention_mask)
    layout = documents.layout if documents is not None else ChunkLayout(settings.cp, settings.layout_rank, length)
    scale = scaling if scaling is not None else default_scale(query.shape[-1])
    value_dim = value.shape[-1]
    query, key, value = _same_head_dim(query, key, value)
    attend = Attend(layout.chunk, scale, sliding_window, softcap, key_mask, documents)
    if torch.compiler.is_compiling():  # a compiled block: the same attention as graph ops (compiled.py)
        from .compiled import eager_document_attention, traced_context_attention

        if documents is not None:  # a packed row's document blocks are chosen in Python: run eagerly
            out = eager_document_attention(query, key, value, attend, layout.chunks_of, settings)
        else:
            name = settings.group.group_name
            out = traced_context_attention(query, key, value, attend, layout, name, settings.strategy)
    elif settings.strategy == "ring":
        out = ring_attention(query, key, value, attend, layout.chunks_of, settings.group)
    else:
        out = all_to_all_attention(query, key, value, attend, layout.chunks_of, settings.group)
    return out[..., :value_dim].transpose(1, 2).contiguous(), None


def _same_head_dim(query, key, value):
    """Keys and values of one head width, as the ring exchanges them together (latent attention's values are
    narrower than its query/key heads): the narrower side padded with zeros, which changes no score and no output
    column that is kept."""
    width = max(key.shape[-1], value.shape[-1])

    def pad(x):
        return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))

    return pad(query), pad(key), pad(value)


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_KEY, context_parallel_attention)
