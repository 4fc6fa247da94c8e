"""TRL's fused LM head on a parallel model: `model(..., labels=labels, fused_lm_head=True)` returns TRL's
`FusedCausalLMOutput`, its per-token fields those of the whole sequence and the whole vocabulary on every rank.

TRL's trainers (DPO, GRPO, SFT) replace `model.forward` with one that multiplies the hidden states by
`lm_head.weight` and scores every label of a row (`trl.trainer.utils.add_fused_lm_head`). On a parallel model that
weight is a slice of the vocabulary (tp) and a rank holds a part of each row (cp), so the forward installed here
runs the model's own forward (logits of this rank's vocabulary slice and sequence chunks), scores the labels with
the vocab-parallel reductions (`tensor_parallel.logprobs`) and, under cp, puts the per-token numbers of every rank
together: every rank then holds the (batch, seq - 1) tensors TRL reads, and its sums over a completion are whole. The
gradient of that gather passes cp x each rank's own part back (data parallelism averages the gradients over dp x cp,
as for the cp loss, `context_parallel/loss.py`).
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ...mesh import ranks
from ...state import parallel_state
from ...tensor_parallel.logprobs import IGNORE_INDEX, token_log_probs, token_statistics, vocab_slice


class _GatherSequence(torch.autograd.Function):
    """The whole sequence from the cp ranks' tokens; backward: this rank's part of the gradient, times cp."""

    @staticmethod
    def forward(ctx, x, layout, group):
        ctx.layout, ctx.cp = layout, ranks.world_size(group)
        return layout.gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.layout.take(grad) * ctx.cp, None, None


def whole_sequence(x: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """Per-token `x` (batch, local tokens) of this cp rank's chunks, as the whole shifted sequence (batch, seq - 1),
    on every cp rank (the identity without cp)."""
    state = parallel_state(model)
    settings = state.context_parallel
    if settings is None:
        return x
    return _GatherSequence.apply(x, state.sequence_layout, settings.group)[:, : state.sequence_length - 1]


def _statistics(logits, labels, head, group: ProcessGroup | None):
    return token_statistics(logits, labels, group, head.vocab_start, head.vocab_size)


def _fused_forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
    """The model's forward; with `fused_lm_head=True` TRL's fused outputs, computed without whole logits (see the
    module docstring). Under cp the input split already shifted and cut `labels` (the model's pre-hook)."""
    forward = type(self).forward
    if not fused_lm_head:
        extra = {"labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch}
        return forward(self, *args, **kwargs, **{k: v for k, v in extra.items() if v is not None})
    from trl.trainer.utils import FusedCausalLMOutput

    if kwargs.get("output_router_logits"):
        raise NotImplementedError(
            "router_aux_loss_coef != 0 is not supported with TRL's fused head on a parallel model (its aux loss is "
            "not computed here); allowed: router_aux_loss_coef=0.0"
        )
    kwargs["use_cache"] = False
    logits = forward(self, *args, **kwargs).logits
    head = vocab_slice(self)
    context = parallel_state(self).context_parallel
    if context is None:
        if shift_labels is None:
            logits, labels = logits[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
    labels = labels.to(logits.device)
    log_probs = whole_sequence(token_log_probs(logits, labels, head.group, head.vocab_start), self)
    stats = _statistics(logits, labels, head, head.group)
    entropy, mean_logits = whole_sequence(stats.entropy, self), whole_sequence(stats.mean_logit, self)
    is_top1 = whole_sequence(stats.correct.float(), self).bool()
    log_sum_sq = whole_sequence(stats.log_sum_sq_probs, self)
    mask = whole_sequence((labels != IGNORE_INDEX).float(), self).bool()
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return FusedCausalLMOutput(
        loss=-log_probs.sum() / count,
        log_probs=log_probs,
        entropy=entropy,
        log_sum_sq_probs=log_sum_sq,
        mean_logits=mean_logits,
        is_top1=is_top1,
        label_mask=mask,
    )


def install_fused_head(model: nn.Module) -> None:
    """Give `model` (a parallel transformers causal LM, the base model of a PEFT model) the parallel fused head,
    replacing the one TRL's trainer added: `model(..., labels=..., fused_lm_head=True)`; other calls run the model's
    own forward."""
    model.forward = types.MethodType(_fused_forward, model)
