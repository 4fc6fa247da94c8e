"""Dropless token dispatch over an expert group: counts first, then the hidden states, with one all-to-all each way.

`all_to_all_rows` is an autograd Function whose backward is the reverse all-to-all (the received rows' gradients go
back to the ranks that sent them). gloo supports `all_to_all_single` with split sizes on CPU, so both backends run
the same call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def exchange_counts(counts: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """`counts` [ep, local experts]: rows this rank sends to each rank's experts; returns the same for the rows it
    receives ([source rank, local expert])."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received.view(-1), counts.contiguous().view(-1), group=group)
    return received


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, send_splits, recv_splits, group, on_backward):
        ctx.send_splits, ctx.recv_splits, ctx.group, ctx.on_backward = send_splits, recv_splits, group, on_backward
        return _exchange(rows, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.on_backward is not None:
            ctx.on_backward()
        return _exchange(grad.contiguous(), ctx.recv_splits, ctx.send_splits, ctx.group), None, None, None, None


def _exchange(rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: ProcessGroup) -> torch.Tensor:
    out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=group)
    return out


def all_to_all_rows(
    rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: ProcessGroup, on_backward=None
) -> torch.Tensor:
    """Send `send_splits[r]` consecutive rows of `rows` to rank r of `group`, receive `recv_splits[r]` from each;
    differentiable (backward: the reverse exchange; `on_backward()` is called first, if given)."""
    return _AllToAllRows.apply(rows, send_splits, recv_splits, group, on_backward)
