"""Context-parallel attention as torch custom ops, for a compiled decoder block (outputs contiguous, as their
fake implementations say).

Ring attention is one op (`ring_attention`: output and log-sum-exp) whose backward is another
(`ring_attention_backward`): inside them the eager code runs unchanged (the key/value exchanges overlapped with the
chunk pairs, the visibility of each pair read from the padding mask, the attention-chunk spans and the image blocks),
and the graph sees one node with its shapes. The all-to-all strategy's exchanges are the graph's own ops
(`comm.compiled.all_to_all`, its own adjoint) around the same op run on one rank. Which chunks a rank holds travels as
a list of ints (every rank's, in rank order), the group as its name; attention sinks as a tensor input of the op, with
their gradient an output of its backward.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from ..comm import compiled as comm
from ..mesh import ranks
from .blocks import Attend, Blocks, Spans, accumulation_dtype
from .ring import ring_attention as eager_ring_attention
from .ring import ring_backward, ring_forward
from .ulysses import all_to_all_attention, rank_heads


def _chunks(chunk_ids: list[int], size: int):
    per_rank = len(chunk_ids) // size
    return lambda rank: tuple(chunk_ids[rank * per_rank : (rank + 1) * per_rank])


def _setting(group: str, key_mask, span_ids, block_ids, chunk, scale, window, softcap, chunk_ids):
    process_group = torch._C._distributed_c10d._resolve_process_group(group) if group else None
    size = ranks.world_size(process_group) if process_group is not None else 1
    spans = Spans.of(span_ids, chunk) if span_ids is not None else None
    blocks = Blocks.of(block_ids, chunk) if block_ids is not None else None
    attend = Attend(chunk, scale, window, softcap, key_mask, spans=spans, blocks=blocks)
    return attend, _chunks(list(chunk_ids), size), process_group


@torch.library.custom_op("optimum_parallel::ring_attention", mutates_args=())
def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sinks: Tensor | None,
    key_mask: Tensor | None,
    span_ids: Tensor | None,
    block_ids: Tensor | None,
    chunk: int,
    scale: float,
    window: int | None,
    softcap: float | None,
    chunk_ids: list[int],
    group: str,
) -> tuple[Tensor, Tensor]:
    """`ring.ring_forward` over the group named `group` ("": one rank holding every chunk): (out, lse). `span_ids`,
    `block_ids`: the whole sequence's attention-chunk spans and image blocks (`blocks.Spans`, `blocks.Blocks`)."""
    masks = (key_mask, span_ids, block_ids)
    attend, chunks, process_group = _setting(group, *masks, chunk, scale, window, softcap, chunk_ids)
    out, lse = ring_forward(q, k, v, attend, chunks, process_group, sinks)
    return out.contiguous(), lse.contiguous()


@torch.library.custom_op("optimum_parallel::ring_attention_backward", mutates_args=())
def ring_attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    sinks: Tensor | None,
    key_mask: Tensor | None,
    span_ids: Tensor | None,
    block_ids: Tensor | None,
    chunk: int,
    scale: float,
    window: int | None,
    softcap: float | None,
    chunk_ids: list[int],
    group: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`ring.ring_backward`: (dq, dk, dv, dsinks); dsinks is empty without sinks (an op's outputs are tensors)."""
    masks = (key_mask, span_ids, block_ids)
    attend, chunks, process_group = _setting(group, *masks, chunk, scale, window, softcap, chunk_ids)
    dq, dk, dv, dsinks = ring_backward(dout, q, k, v, out, lse, attend, chunks, process_group, sinks)
    dsinks = q.new_zeros(0) if dsinks is None else dsinks
    # dk and dv may be views of one buffer: outputs may not alias
    return dq.contiguous(), dk.clone(), dv.clone(), dsinks


@ring_attention.register_fake
def _(q, k, v, sinks, key_mask, span_ids, block_ids, chunk, scale, window, softcap, chunk_ids, group):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=accumulation_dtype(q.dtype))


@ring_attention_backward.register_fake
def _(dout, q, k, v, out, lse, sinks, key_mask, span_ids, block_ids, chunk, scale, window, softcap, chunk_ids, group):
    dsinks = q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup(ctx, inputs, output):
    q, k, v, sinks, *settings = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks)
    ctx.settings = settings


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = ring_attention_backward(dout, q, k, v, out, lse, sinks, *ctx.settings)
    return dq, dk, dv, None if sinks is None else dsinks, *([None] * len(ctx.settings))


ring_attention.register_autograd(_backward, setup_context=_setup)


def _sequence_to_heads(x: Tensor, group: str, cp: int) -> Tensor:
    """As `ulysses._sequence_to_heads`, the exchange a graph op."""
    b, h, length, d = x.shape
    received = comm.all_to_all(x.view(b, cp, h // cp, length, d).transpose(0, 1).contiguous(), group)
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * length, d)


def _heads_to_sequence(x: Tensor, group: str, cp: int) -> Tensor:
    """As `ulysses._heads_to_sequence`."""
    b, h, total, d = x.shape
    received = comm.all_to_all(x.view(b, h, cp, total // cp, d).permute(2, 0, 1, 3, 4).contiguous(), group)
    return received.transpose(0, 1).reshape(b, cp * h, total // cp, d)


def traced_context_attention(
    q, k, v, attend: Attend, layout, group: str, strategy: str, sinks=None, span_ids=None, block_ids=None
) -> Tensor:
    """Context-parallel attention as a compiled graph runs it: q (b, h, 2c, d), k, v (b, h_kv, 2c, d) of this rank's
    chunks -> its output chunks (b, h, 2c, d). `sinks` (h,), `span_ids` and `block_ids` (the whole sequence's, see
    `blocks.Spans` / `blocks.Blocks`) or None; `attend` carries neither spans nor blocks (they are read in the op)."""
    every = [i for rank in range(layout.cp) for i in layout.chunks_of(rank)]
    masks = (attend.key_mask, span_ids, block_ids)
    settings = (attend.chunk, attend.scale, attend.window, attend.softcap)
    if strategy == "ring":
        out, _ = ring_attention(q, k, v, sinks, *masks, *settings, every, group)
        return out
    cp = layout.cp
    q, k, v = (_sequence_to_heads(t, group, cp) for t in (q, k, v))
    out, _ = ring_attention(q, k, v, rank_heads(sinks, cp, layout.rank), *masks, *settings, every, "")
    return _heads_to_sequence(out, group, cp)


@torch.compiler.disable
def eager_document_attention(q, k, v, attend: Attend, chunks_of, settings, sinks=None, span_ids=None) -> Tensor:
    """A packed row's attention inside a compiled block, run eagerly: which chunk pairs share a document is read in
    Python from its boundaries (the one graph break a packed row costs under cp), and so are its attention chunks."""
    if span_ids is not None:
        attend = replace(attend, spans=Spans.of(span_ids, attend.chunk))
    if settings.strategy == "ring":
        return eager_ring_attention(q, k, v, attend, chunks_of, settings.group, sinks)
    return all_to_all_attention(q, k, v, attend, chunks_of, settings.group, sinks)
