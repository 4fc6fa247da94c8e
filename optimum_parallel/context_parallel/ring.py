"""Ring attention: the key / value chunks travel around the cp ring while each rank attends its query chunks to the
chunks it holds; partial results merge by log-sum-exp, so the result is exact. `ring_attention` (the autograd function
`RingAttention`, over `ring_forward` / `ring_backward`) also takes attention sinks. Design notes: docs/module_notes.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..mesh import ranks
from .blocks import (
    NEG_INF,
    Attend,
    accumulation_dtype,
    add_sinks,
    attend_chunks,
    attend_chunks_backward,
    merge,
    sinks_grad,
)

_KEYS_TAG, _GRADS_TAG = 11, 12


class _RingExchange:
    """Send `tensor` to the next rank of the ring and receive the previous rank's, asynchronously."""

    def __init__(self, tensor: torch.Tensor, group: ProcessGroup, tag: int) -> None:
        ring, rank, size = ranks.group_ranks(group), ranks.rank(group), ranks.world_size(group)
        self.received = torch.empty_like(tensor)
        self.works = [
            dist.isend(tensor.contiguous(), ring[(rank + 1) % size], group=group, tag=tag),
            dist.irecv(self.received, ring[(rank - 1) % size], group=group, tag=tag),
        ]

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


def _ring(group: ProcessGroup | None) -> tuple[int, int]:
    return (0, 1) if group is None else (ranks.rank(group), ranks.world_size(group))


def ring_forward(
    q, k, v, attend: Attend, chunks, group: ProcessGroup | None, sinks: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and its log-sum-exp (see `RingAttention`), the sinks (if any) in both."""
    rank, size = _ring(group)
    groups = q.shape[1] // k.shape[1]
    mine = chunks(rank)
    outs: list = [(None, None)] * len(mine)
    keys = torch.stack([k, v])
    for step in range(size):
        exchange = _RingExchange(keys, group, _KEYS_TAG) if step + 1 < size else None
        src = (rank - step) % size
        parts = attend_chunks(q, keys[0], keys[1], mine, chunks(src), attend, groups)
        outs = [merge(*o, *p) for o, p in zip(outs, parts, strict=True)]
        if exchange is not None:
            keys = exchange.wait()
    b, h, _, d = q.shape
    out = torch.cat([o if o is not None else q.new_zeros(b, h, attend.chunk, d) for o, _ in outs], dim=2)
    lse = torch.cat(
        [
            s if s is not None else q.new_full((b, h, attend.chunk), NEG_INF, dtype=accumulation_dtype(q.dtype))
            for _, s in outs
        ],
        dim=2,
    )
    return (out, lse) if sinks is None else add_sinks(out, lse, sinks)


def ring_backward(dout, q, k, v, out, lse, attend: Attend, chunks, group: ProcessGroup | None, sinks=None):
    """dq, dk, dv of `ring_forward`'s output given its gradient `dout`, and the sinks' gradient (None without)."""
    rank, size = _ring(group)
    groups = q.shape[1] // k.shape[1]
    mine = chunks(rank)
    dout = dout.contiguous()
    dq = torch.zeros_like(q, dtype=accumulation_dtype(q.dtype))
    keys = torch.stack([k, v])
    travelling = None  # the gradient of the keys held now, from the ranks they visited before
    for step in range(size):
        exchange = _RingExchange(keys, group, _KEYS_TAG) if step + 1 < size else None
        src = (rank - step) % size
        dq_part, dk, dv = attend_chunks_backward(dout, q, keys[0], keys[1], out, lse, mine, chunks(src), attend, groups)
        dq += dq_part
        grads = torch.stack([dk, dv])
        if travelling is not None:
            grads += travelling.wait()
        if size == 1:
            travelling = grads
            break
        travelling = _RingExchange(grads, group, _GRADS_TAG)  # on to the next holder; after the last step
        if exchange is not None:  # it reaches the owner
            keys = exchange.wait()
    grads = travelling if size == 1 else travelling.wait()
    dsinks = None if sinks is None else sinks_grad(dout, out, lse, sinks)
    return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), dsinks


class RingAttention(torch.autograd.Function):
    """q (b, h, 2c, d), k and v (b, h_kv, 2c, d) hold this rank's two chunks; `chunks(r)` gives rank r's chunk
    ids. With `group=None` a single rank holds every chunk `chunks(0)` names (the all-to-all strategy). `sinks`:
    (h,) logits that join each head's softmax, or None."""

    @staticmethod
    def forward(ctx, q, k, v, attend: Attend, chunks, group, sinks):
        out, lse = ring_forward(q, k, v, attend, chunks, group, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.attend, ctx.chunks, ctx.group = attend, chunks, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv, dsinks = ring_backward(dout, q, k, v, out, lse, ctx.attend, ctx.chunks, ctx.group, sinks)
        return dq, dk, dv, None, None, None, dsinks


def ring_attention(
    q, k, v, attend: Attend, chunks, group: ProcessGroup | None, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    return RingAttention.apply(q, k, v, attend, chunks, group, sinks)
