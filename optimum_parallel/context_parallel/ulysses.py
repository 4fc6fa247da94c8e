"""All-to-all (Ulysses) attention: trade the sequence split for a head split, attend over the whole sequence,
trade back. Two all-to-alls of q, k, v and one of the output per layer, against cp - 1 key / value transfers for
the ring; it needs the query and key / value heads (after tensor parallelism) to divide by cp."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..mesh import ranks
from .blocks import Attend
from .ring import ring_attention


def _all_to_all(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _sequence_to_heads(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """(b, h, L, d) holding L tokens -> (b, h / cp, cp L, d) holding every rank's tokens, rank by rank."""
    cp = ranks.world_size(group)
    b, h, length, d = x.shape
    received = _all_to_all(x.view(b, cp, h // cp, length, d).transpose(0, 1), group)
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * length, d)


def _heads_to_sequence(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The inverse of `_sequence_to_heads`."""
    cp = ranks.world_size(group)
    b, h, total, d = x.shape
    received = _all_to_all(x.view(b, h, cp, total // cp, d).permute(2, 0, 1, 3, 4), group)
    return received.transpose(0, 1).reshape(b, cp * h, total // cp, d)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_sequence(grad, ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _sequence_to_heads(grad, ctx.group), None


def check_heads_divide(query_heads: int, kv_heads: int, cp: int, key: str = "context_parallel_strategy") -> None:
    """All-to-all trades the sequence split for a head split: the heads per tensor-parallel rank must divide by cp."""
    if query_heads % cp or kv_heads % cp:
        raise ValueError(
            f"{key}='all_to_all' needs the attention heads per tensor-parallel rank to divide by cp={cp}; here "
            f"{query_heads} query and {kv_heads} key/value heads. Use the 'ring' strategy (allowed: ring, or "
            "all_to_all with heads per tp rank divisible by cp)"
        )


def rank_heads(sinks: torch.Tensor | None, cp: int, rank: int) -> torch.Tensor | None:
    """The per-head sinks of the heads this rank holds after the exchange (its share of them, in rank order)."""
    if sinks is None:
        return None
    share = sinks.shape[0] // cp
    return sinks.narrow(0, rank * share, share)


def all_to_all_attention(
    q, k, v, attend: Attend, chunks, group: ProcessGroup, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """q (b, h, 2c, d), k, v (b, h_kv, 2c, d) of this rank's chunks -> its output chunks (b, h, 2c, d); `sinks`: (h,)
    or None."""
    cp = ranks.world_size(group)
    check_heads_divide(q.shape[1], k.shape[1], cp)
    order = tuple(i for rank in range(cp) for i in chunks(rank))  # the chunks as the all-to-all lays them out
    q, k, v = (_SequenceToHeads.apply(t, group) for t in (q, k, v))
    out = ring_attention(q, k, v, attend, lambda _: order, None, rank_heads(sinks, cp, ranks.rank(group)))
    return _HeadsToSequence.apply(out, group)
