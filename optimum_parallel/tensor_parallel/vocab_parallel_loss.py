"""Vocab-parallel cross-entropy: the loss of logits split over the vocabulary, without gathering them.

Per token it moves two all-reduces of O(tokens) numbers (max, then [target logit, sum of exp]),
never the tokens x vocab logits.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup, ReduceOp

from ..comm.collectives import all_reduce
from ..mesh import ranks


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, ignore_index):
        logits = logits.float()
        vocab_start = ranks.device_scalar(vocab_start, logits.device)  # on XLA: data, not a per-rank constant
        vocab_end = vocab_start + logits.shape[-1]
        logits_max = logits.amax(dim=-1)  # amax: no indices (max(dim) computes them, ~9x slower here)
        all_reduce(logits_max, group, op=ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)

        ours = (target >= vocab_start) & (target < vocab_end)
        local_target = (target - vocab_start).masked_fill(~ours, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~ours, 0.0)
        exp = shifted.exp_()  # reuse the buffer: `shifted` is not needed any more
        sums = torch.stack([target_logit, exp.sum(dim=-1)])
        all_reduce(sums, group)
        target_logit, sum_exp = sums

        ignored = target == ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        ctx.save_for_backward(exp, sum_exp, local_target, ours, ignored)  # softmax = exp / sum_exp, in backward
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        exp, sum_exp, local_target, ours, ignored = ctx.saved_tensors
        scale = grad_loss.masked_fill(ignored, 0.0)
        # d loss / d logits = (softmax - one_hot(target)) * grad, in place: one pass over the logits
        grad = exp.mul_((scale / sum_exp).unsqueeze(-1))
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(ours * scale).unsqueeze(-1).to(grad.dtype))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: ProcessGroup, vocab_start: int, ignore_index: int = -100
) -> torch.Tensor:
    """Per-token loss (0 where target == ignore_index); `logits` hold vocab ids [vocab_start, vocab_start + V_local)."""
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_start, ignore_index)


class VocabParallelLMLoss:
    """Drop-in for transformers' `ForCausalLMLoss` / `ForMaskedLMLoss` when the LM head is vocab-parallel.

    Same arguments and the same reduction: mean over non-ignored tokens, or sum / `num_items_in_batch`.
    """

    def __init__(self, group: ProcessGroup, vocab_start: int, shift: bool) -> None:
        self.group, self.vocab_start, self.shift = group, vocab_start, shift

    def __call__(
        self, logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs
    ):
        if self.shift and shift_labels is None:
            labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        elif shift_labels is not None:
            labels = shift_labels
        labels = labels.reshape(-1).to(logits.device)
        losses = vocab_parallel_cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels, self.group, self.vocab_start, ignore_index
        )
        if num_items_in_batch is None:
            return losses.sum() / (labels != ignore_index).sum()
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(losses.device)
        return losses.sum() / num_items_in_batch
