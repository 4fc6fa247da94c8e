"""Packed (fused) column splits: one weight holding several parts (q|k|v, gate|up), each part split over tp.

Splitting the fused block as a whole would hand rank 0 all of q and rank 1 all of v; splitting each
part keeps every rank's local output a valid smaller fused output ([q_local | k_local | v_local]).
The layout comes from a packed `ShardSpec` (one range per part). A part with fewer heads than tp ranks is
replicated over tp/heads ranks, and the gradients of its rows are summed over those replicas (in
the forward path, like ColumnParallelLinear's replicated kv heads).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from ..comm.tp_entry import LayerWiring
from .layers import ColumnParallelLinear
from .spec import ReplicatedSegment


class _SumSegmentGrads(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient rows of each replicated segment over its group."""

    @staticmethod
    def forward(ctx, param, dim, segments):
        ctx.dim, ctx.segments = dim, segments
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        for segment, group in ctx.segments:
            rows = grad.narrow(ctx.dim, segment.start, segment.length).contiguous()
            dist.all_reduce(rows, group=group)
            grad.narrow(ctx.dim, segment.start, segment.length).copy_(rows)
        return grad, None, None


def sum_segment_grads(
    param: torch.Tensor, dim: int, segments: Sequence[tuple[ReplicatedSegment, ProcessGroup]]
) -> torch.Tensor:
    """`param` as the forward uses it: the gradient rows of its replicated heads are summed over their replicas.

    Done in the forward path (not with a parameter hook), so it composes with DDP/FSDP2 and accumulation.
    """
    if not segments or not param.requires_grad or not torch.is_grad_enabled():
        return param
    return _SumSegmentGrads.apply(param, dim, tuple(segments))


class PackedColumnParallelLinear(ColumnParallelLinear):
    """A column-parallel Linear over a packed layout; replicated parts have their gradients summed."""

    defers_weight_grads = False  # its weight goes through the segment sums: no alias to defer

    def __init__(
        self,
        weight,
        bias,
        group,
        segments: Sequence[tuple[ReplicatedSegment, ProcessGroup]] = (),
        wiring: LayerWiring | None = None,
    ) -> None:
        super().__init__(weight, bias, group, wiring=wiring)
        self.segments = tuple(segments)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gather_output:
            raise ValueError("a packed column-parallel layer cannot gather its output (the parts are interleaved)")
        if self.wiring.entry is not None:
            x = self.wiring.entry(x, self.group, self.wiring.splits_sequence())
        weight = sum_segment_grads(self.weight, 0, self.segments)
        bias = sum_segment_grads(self.bias, 0, self.segments) if self.bias is not None else None
        return F.linear(x, weight, bias)
