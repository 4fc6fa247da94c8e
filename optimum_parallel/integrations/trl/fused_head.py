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

import contextlib
import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from ...mesh import ranks
from ...plan import logits_mode
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


class FusedHead:
    """`model.forward` of a parallel model given TRL's fused head (see the module docstring and `install_fused_head`).

    Under pp the forward runs through the pipeline's stages without a graph (`run_eval`), the last stage scores the
    labels and sends the per-token numbers to the other stages; the log-probabilities are then a leaf
    (`pipeline_log_probs`) whose gradient, once the caller's loss is backpropagated to it, weighs each token in the
    pipeline's own backward (`ParallelDPOTrainer.training_step`)."""

    def __init__(self, model: nn.Module, temperature: float = 1.0) -> None:
        self.model = model
        self.temperature = temperature  # the logits are divided by it, as TRL's fused head divides them
        self.pipeline_log_probs: torch.Tensor | None = None
        # the model's own signature: `generate` checks its keyword arguments against it (as TRL's fused forward keeps)
        self.__signature__ = inspect.signature(type(model).forward.__get__(model))

    def __call__(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        model = self.model
        state = parallel_state(model)
        if not fused_lm_head:
            if "forward" in state.unsupported:  # pp: the pipeline runs the model
                raise RuntimeError(state.unsupported["forward"])
            extra = {"labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch}
            return type(model).forward(model, *args, **kwargs, **{k: v for k, v in extra.items() if v is not None})
        from trl.trainer.utils import FusedCausalLMOutput

        if kwargs.get("output_router_logits"):
            raise NotImplementedError(
                "router_aux_loss_coef != 0 is not supported with TRL's fused head on a parallel model (its aux loss "
                "is not computed here); allowed: router_aux_loss_coef=0.0"
            )
        if state.pipeline is not None:
            fields = self._through_pipeline(state.pipeline, kwargs, labels, shift_labels)
        else:
            fields = self._through_model(kwargs, labels, shift_labels)
        log_probs, entropy, log_sum_sq, mean_logits, is_top1, mask = fields
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

    def _through_model(self, kwargs: dict, labels, shift_labels) -> tuple:
        """The model's own forward (this rank's vocabulary slice; under cp its chunks, the labels cut by the input
        split), the per-token numbers put together over cp."""
        model = self.model
        kwargs["use_cache"] = False
        logits = type(model).forward(model, **kwargs).logits
        if self.temperature != 1.0:
            logits = logits / self.temperature
        head = vocab_slice(model)
        if parallel_state(model).context_parallel is None:
            if shift_labels is None:
                logits, labels = logits[:, :-1], labels[:, 1:]
            else:
                labels = shift_labels
        labels = labels.to(logits.device)
        log_probs = whole_sequence(token_log_probs(logits, labels, head.group, head.vocab_start), model)
        stats = _statistics(logits, labels, head, head.group)
        per_token = [stats.entropy, stats.log_sum_sq_probs, stats.mean_logit, stats.correct.float()]
        entropy, log_sum_sq, mean_logits, is_top1 = (whole_sequence(x, model) for x in per_token)
        mask = whole_sequence((labels != IGNORE_INDEX).float(), model).bool()
        return log_probs, entropy, log_sum_sq, mean_logits, is_top1.bool(), mask

    def _through_pipeline(self, pipeline, kwargs: dict, labels, shift_labels) -> tuple:
        if shift_labels is not None:
            raise NotImplementedError("shift_labels with the fused head under pipeline parallelism")
        input_ids, mask = kwargs["input_ids"], kwargs.get("attention_mask")
        split = pipeline.holds_last and vocab_slice(self.model).group is not None
        with logits_mode(self.model, "local") if split else contextlib.nullcontext():  # scored on this rank's slice
            logits = pipeline.run_eval(input_ids=input_ids, attention_mask=mask).logits
        if pipeline.holds_last and self.temperature != 1.0:
            logits = logits / self.temperature
        targets = labels[:, 1:].to(input_ids.device)
        fields = torch.zeros(5, *targets.shape, device=input_ids.device)
        if pipeline.holds_last:
            head = vocab_slice(self.model)
            stats = _statistics(logits[:, :-1], targets, head, head.group)
            per_token = [stats.log_prob, stats.entropy, stats.log_sum_sq_probs, stats.mean_logit, stats.correct]
            fields = torch.stack([x.float() for x in per_token])
        dist.broadcast(fields, src=pipeline.last_rank, group=pipeline.pp_group)
        log_probs = fields[0].clone().requires_grad_(torch.is_grad_enabled())
        if torch.is_grad_enabled():  # the policy's (a LoRA policy's reference runs after it, without a graph)
            self.pipeline_log_probs = log_probs
        return log_probs, fields[1], fields[2], fields[3], fields[4].bool(), targets != IGNORE_INDEX


def install_fused_head(model: nn.Module, temperature: float = 1.0) -> FusedHead:
    """Give `model` (a parallel transformers causal LM, the base model of a PEFT model) the parallel fused head,
    replacing the one TRL's trainer added: `model(..., labels=..., fused_lm_head=True)`, the logits divided by
    `temperature` (as TRL's `add_fused_lm_head`); other calls run the model's own forward (under pp they raise, as
    before). Installed once; returns the head."""
    current = model.__dict__.get("forward")
    if isinstance(current, FusedHead):
        current.temperature = temperature
        return current
    head = FusedHead(model, temperature)
    model.forward = head
    return head
