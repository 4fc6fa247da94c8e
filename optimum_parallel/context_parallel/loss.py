"""The loss under context parallelism: the mean over every token of every cp rank, exactly the one-device loss.

Each rank computes the sum of its tokens' losses over the whole sequence's token count (counted over cp when
the caller gives no `num_items_in_batch`); the forward sums these over cp. The backward passes cp x the
gradient to each rank's part, so that data parallelism, which AVERAGES gradients over dp x cp, yields the sum
over the cp ranks' partial gradients (each rank's backward covers the computation on its own tokens; ring
attention returns the key / value gradients to their owners) and the mean over dp replicas.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..mesh import ranks


class _SumOverContext(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial, group):
        ctx.cp = ranks.world_size(group)
        total = partial.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.cp, None


class ContextParallelLoss:
    """Wraps the model's `loss_function` (transformers' or the vocab-parallel one). The labels it receives are
    already shifted (the input split shifts them before cutting the sequence, so no token loses its target)."""

    def __init__(self, inner, group: ProcessGroup) -> None:
        self.inner, self.group = inner, group

    def __call__(self, logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100, **kwargs):
        kwargs.pop("shift_labels", None)
        if num_items_in_batch is None:
            count = (labels != ignore_index).sum().to(logits.device)
            dist.all_reduce(count, group=self.group)
            num_items_in_batch = count
        partial = self.inner(
            logits=logits,
            labels=labels,
            vocab_size=vocab_size,
            num_items_in_batch=num_items_in_batch,
            ignore_index=ignore_index,
            shift_labels=labels,
            **kwargs,
        )
        return _SumOverContext.apply(partial, self.group)
