"""TRL's fused LM head on a parallel model (`install_fused_head`, `FusedHead`): `model(..., labels=labels,
fused_lm_head=True)` returns TRL's `FusedCausalLMOutput`, its per-token fields those of the whole sequence and the
whole vocabulary on every rank, scored against this rank's vocabulary slice and put together over cp
(`whole_sequence`). Used by the DPO, GRPO, RLOO and KTO trainers. Design notes: docs/module_notes.md.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from ...comm.autograd_collectives import copy_to_tensor_parallel_region
from ...mesh import ranks
from ...plan import logits_mode
from ...state import parallel_state
from ...tensor_parallel.layers import ColumnParallelLinear
from ...tensor_parallel.logprobs import (
    IGNORE_INDEX,
    LogitTransform,
    head_token_scores,
    token_log_probs,
    token_statistics,
    vocab_slice,
)


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


def logit_transform(model: nn.Module, temperature: float = 1.0) -> LogitTransform:
    """What `model`'s own forward does to its LM head's output, read from its config as TRL's `add_fused_lm_head`
    reads it (logit_scale, output_multiplier, lm_head_multiplier or logits_scaling; final_logit_softcapping), then
    the division by `temperature`."""
    config = model.config.get_text_config()
    scale = getattr(config, "logit_scale", None)
    if scale is None:
        scale = getattr(config, "output_multiplier", None)
    if scale is None:
        scale = getattr(config, "lm_head_multiplier", None)
    logits_scaling = getattr(config, "logits_scaling", None)
    if scale is None and logits_scaling is not None:  # HyperCLOVA X multiplies by it, Granite and MiniCPM3 divide
        scale = logits_scaling if config.model_type == "hyperclovax" else 1 / logits_scaling
    softcap = getattr(config, "final_logit_softcapping", None)
    return LogitTransform(1.0 if scale is None else scale, softcap, temperature)


@dataclass(frozen=True)
class HeadProjection:
    """The LM head the chunked path multiplies the hidden states by: the module (nn.Linear, or a vocab-parallel
    ColumnParallelLinear) and the backbone that feeds it."""

    head: nn.Module
    backbone: nn.Module

    def enter(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden states as the head's slice reads them: through its tp region's entry (identity forward,
        all-reduce of the gradient backward; the sequence all-gathered under sp), as the head's own forward enters."""
        head = self.head
        entry = getattr(getattr(head, "wiring", None), "entry", None)
        if not isinstance(head, ColumnParallelLinear) or entry is None:  # one rank's head, or entered by the caller
            return hidden
        return entry(hidden, head.group, head.wiring.splits_sequence())

    def weight(self) -> torch.Tensor:
        head = self.head
        replicas = getattr(head, "replica_group", None)  # a replicated shard: its gradient summed over the replicas
        return head.weight if replicas is None else copy_to_tensor_parallel_region(head.weight, replicas)

    def bias(self) -> torch.Tensor | None:
        head, replicas = self.head, getattr(self.head, "replica_group", None)
        if head.bias is None or replicas is None:
            return head.bias
        return copy_to_tensor_parallel_region(head.bias, replicas)


def head_projection(model: nn.Module) -> HeadProjection | None:
    """`model`'s LM head for the chunked path, or None where the model's own forward must compute the logits: a head
    wrapped (an adapter, FSDP2 unit) or hooked, one that gathers its output, a weight held as a DTensor, a model
    without a backbone of its own (`base_model`)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    if isinstance(head, ColumnParallelLinear):
        if head.gather_output:
            return None
    elif type(head) is not nn.Linear:
        return None
    if head._forward_pre_hooks or head._forward_hooks or isinstance(head.weight, DTensor):
        return None
    backbone = getattr(model, "base_model", None)
    if backbone is None or backbone is model:
        return None
    return HeadProjection(head, backbone)


class FusedHead:
    """`model.forward` of a parallel model given TRL's fused head (docs/module_notes.md and `install_fused_head`).

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
        elif (projection := head_projection(self.model)) is not None:
            fields = self._through_head(projection, kwargs, labels, shift_labels)
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

    def _through_head(self, projection: HeadProjection, kwargs: dict, labels, shift_labels) -> tuple:
        """The backbone's hidden states (under cp this rank's chunks, the labels cut by the input split), the labelled
        positions scored a chunk of tokens at a time against this rank's slice of the head, the per-token numbers
        put together over cp."""
        model = self.model
        kwargs["use_cache"] = False
        hidden = projection.enter(projection.backbone(**kwargs).last_hidden_state)
        if parallel_state(model).context_parallel is None:
            if shift_labels is None:
                hidden, labels = hidden[:, :-1], labels[:, 1:]
            else:
                labels = shift_labels
        weight = projection.weight()
        hidden, labels = hidden.to(weight.device), labels.to(weight.device)
        mask = labels != IGNORE_INDEX
        where = vocab_slice(model)
        transform = logit_transform(model, self.temperature)
        scores = head_token_scores(
            hidden[mask], weight, projection.bias(), labels[mask], where.group, where.vocab_start, where.vocab_size,
            transform,
        )  # fmt: skip

        def placed(x: torch.Tensor) -> torch.Tensor:  # (labelled tokens,) -> (batch, tokens), 0 elsewhere
            return whole_sequence(x.new_zeros(mask.shape).masked_scatter(mask, x), model)

        per_token = [scores.log_prob, scores.entropy, scores.log_sum_sq_probs, scores.mean_logit]
        log_probs, entropy, log_sum_sq, mean_logits = (placed(x) for x in per_token)
        is_top1 = placed(scores.correct.float()).bool()
        return log_probs, entropy, log_sum_sq, mean_logits, is_top1, whole_sequence(mask.float(), model).bool()

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
