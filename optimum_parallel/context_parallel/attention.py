"""The attention function a context-parallel model runs, registered in transformers' `AttentionInterface`.

The model's attention modules call it with this rank's query / key / value chunks (already rotated by their
global positions) and, as `attention_mask`, the marker the input split made: (batch, 1, 1, seq) bool over the
whole sequence, True = a real token. transformers hands a 4-D mask to the layers untouched, so the causal,
padding and sliding-window masks are built here, pair of chunks by pair of chunks, from global positions, and so are
llama4's attention chunks (`attention_chunk_size` on the layers config.layer_types names 'chunked_attention', counted
from each row's first real token as transformers' `create_chunked_causal_mask` counts them) and Gemma 3's image blocks
(carried by the marker, see `sequence_mask`). Attention sinks (`s_aux`, one logit per query head: gpt_oss) join each
head's softmax. The same function serves models loaded with eager or sdpa attention (both are exact softmax attention).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.distributed import ProcessGroup

from ..state import find_state
from .blocks import Attend, Blocks, Spans, default_scale
from .load_balance import ChunkLayout
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
_BLOCKS = "_optimum_parallel_blocks"


@dataclass(frozen=True)
class ContextParallelAttention:
    """Set on every attention module of a context-parallel model."""

    group: ProcessGroup
    layout_rank: int
    cp: int
    strategy: str


def sequence_mask(
    key_mask: torch.Tensor, documents: Documents | None = None, blocks: torch.Tensor | None = None
) -> torch.Tensor:
    """The marker the layers receive as `attention_mask`: the whole sequence's (batch, seq) padding mask, for a
    packed batch its documents and layout (packed.py), and where a model's image tokens attend both ways (Gemma 3)
    the block of every token ((batch, seq), -1 outside any: `blocks.Blocks`)."""
    marker = key_mask.bool()[:, None, None, :]
    setattr(marker, _MARK, bool(key_mask.all()))
    setattr(marker, _DOCUMENTS, documents)
    setattr(marker, _BLOCKS, blocks)
    return marker


def is_marker(attention_mask) -> bool:
    """Whether `attention_mask` is the marker the input split made (`sequence_mask`)."""
    return getattr(attention_mask, _MARK, None) is not None


def marked_documents(attention_mask) -> Documents | None:
    """The documents a marker carries (None: one sequence per row)."""
    return getattr(attention_mask, _DOCUMENTS, None)


def marked_blocks(attention_mask) -> torch.Tensor | None:
    """The image blocks a marker carries ((batch, seq), -1 outside any; None: none)."""
    return getattr(attention_mask, _BLOCKS, None)


def attention_chunk_size(module) -> int | None:
    """The span a chunked-attention layer's queries see (llama4: `attention_chunk_size` where config.layer_types names
    the layer 'chunked_attention'); None for any other layer."""
    config = getattr(module, "config", None)
    size = getattr(config, "attention_chunk_size", None)
    types, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if not size or types is None or not isinstance(index, int) or index >= len(types):
        return None
    return size if types[index] == "chunked_attention" else None


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
    sinks = _sinks(module, kwargs.get("s_aux"), query.shape[1])
    key_mask, length = _read_mask(attention_mask)
    documents = marked_documents(attention_mask)
    layout = documents.layout if documents is not None else ChunkLayout(settings.cp, settings.layout_rank, length)
    scale = scaling if scaling is not None else default_scale(query.shape[-1])
    span = attention_chunk_size(module)
    spans = None if span is None else span_ids(span, key_mask, documents, length, query.device)
    blocks = marked_blocks(attention_mask)
    query = _global_temperature(module, query, layout)
    value_dim = value.shape[-1]
    query, key, value = _same_head_dim(query, key, value)
    attend = Attend(layout.chunk, scale, sliding_window, softcap, key_mask, documents)
    if torch.compiler.is_compiling():  # a compiled block: the same attention as graph ops (compiled.py)
        from .compiled_attention import eager_document_attention, traced_context_attention

        if documents is not None:  # a packed row's document blocks are chosen in Python: run eagerly
            out = eager_document_attention(query, key, value, attend, layout.chunks_of, settings, sinks, spans)
        else:
            name = settings.group.group_name
            out = traced_context_attention(
                query, key, value, attend, layout, name, settings.strategy, sinks, spans, blocks
            )
    else:
        attend = replace(
            attend,
            spans=None if spans is None else Spans.of(spans, layout.chunk),
            blocks=None if blocks is None else Blocks.of(blocks, layout.chunk),
        )
        if settings.strategy == "ring":
            out = ring_attention(query, key, value, attend, layout.chunks_of, settings.group, sinks)
        else:
            out = all_to_all_attention(query, key, value, attend, layout.chunks_of, settings.group, sinks)
    return out[..., :value_dim].transpose(1, 2).contiguous(), None


def _sinks(module, sinks, heads: int) -> torch.Tensor | None:
    """The attention sinks passed as `s_aux`: one logit per query head of this rank, or None. A module holding
    `sinks` it did not pass, or sinks of another shape, is refused (found before composing where the structure shows
    it, autoplan/structure.py; this is the last guard, never a silent answer)."""
    name = type(module).__name__
    if sinks is None:
        if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
            raise NotImplementedError(
                f"{name} holds attention sinks but did not pass them to the attention function as s_aux: the "
                "context-parallel attention cannot tell how they join the softmax"
            )
        return None
    if sinks.dim() != 1 or sinks.shape[0] != heads:
        raise NotImplementedError(
            f"{name}: attention sinks of shape {tuple(sinks.shape)} are not computed under context parallelism "
            f"(one logit per query head, ({heads},) on this rank, is)"
        )
    return sinks


def span_ids(size: int, key_mask, documents: Documents | None, length: int, device) -> torch.Tensor:
    """Every token's attention chunk of `size` tokens ((rows, length), non-decreasing along a row): counted from each
    row's first real token (as transformers' `create_chunked_causal_mask` counts them past left padding), or in a
    packed row from each document's position ids."""
    if documents is not None:
        return documents.span_ids(size).to(device)
    index = torch.arange(length, device=device)[None, :]
    if key_mask is None:
        return torch.div(index, size, rounding_mode="floor")
    left = (key_mask.to(device).long().cumsum(-1) == 0).sum(-1, keepdim=True)
    return torch.div(index - left, size, rounding_mode="floor")


def _global_temperature(module, query: torch.Tensor, layout) -> torch.Tensor:
    """llama4's layers without rotary embeddings scale their queries by log1p(floor((p + 1) / floor_scale)) *
    attn_scale + 1 at position p, p counted by transformers from the local tokens (0, 1, ...): rescaled here to the
    tokens' places in the whole sequence (no change below `floor_scale` tokens)."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return query
    floor_scale, attn_scale = module.floor_scale, module.attn_scale
    if layout.length < floor_scale:  # every place's scale is 1
        return query

    def temperature(positions):
        return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0

    c = layout.chunk
    places = torch.cat([torch.arange(i * c, (i + 1) * c, device=query.device) for i in layout.mine])
    local = torch.arange(query.shape[2], device=query.device)
    ratio = temperature(places) / temperature(local)
    return (query * ratio[None, None, :, None]).to(query.dtype)


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
