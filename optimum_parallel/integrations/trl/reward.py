"""TRL's `RewardTrainer` with `ParallelTrainerMixin` (`ParallelRewardTrainer`, `ParallelRewardConfig`): an outcome
reward model (`AutoModelForSequenceClassification`, one label) trained on a tp / sp / cp / pp / dp (sharding levels
0-3) mesh, equal to TRL's `RewardTrainer` on one process. `reward_model_kwargs` is what TRL passes `from_pretrained`;
`check_reward_options` refuses what cannot run. Design notes: docs/module_notes.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoModelForSequenceClassification, PreTrainedModel, set_seed
from transformers.modeling_outputs import SequenceClassifierOutputWithPast
from trl import RewardConfig, RewardTrainer
from trl.trainer.reward_trainer import suppress_seqcls_warning

from ...context_parallel import pooled_positions
from ...plan.wrappers import plan_root
from ...state import parallel_state
from ..transformers.internals import check_overrides
from ..transformers.trainer import ParallelTrainerMixin
from ..transformers.training_args import ParallelTrainingArguments
from .pipeline_pass import check_whole_rows, surrogate_loss

IGNORE_INDEX = -100


@dataclass
class ParallelRewardConfig(RewardConfig, ParallelTrainingArguments):
    """TRL's `RewardConfig` plus the mesh and parallelism settings of `ParallelTrainingArguments`; `RewardConfig`
    first, so TRL's defaults (learning rate, bf16, logging_steps, ...) win over `TrainingArguments`' own."""


def check_reward_options(args: RewardConfig, quantization_config: Any = None) -> None:
    """ValueError naming the first option ParallelRewardTrainer cannot run."""
    check_whole_rows(args, "ParallelRewardTrainer", "the pipeline's pass pools whole rows")
    if quantization_config is not None:
        raise ValueError(
            "quantization_config is not supported by ParallelRewardTrainer (the parallel layers hold plain weights); "
            "allowed: None"
        )


def reward_model_kwargs(args: RewardConfig, model_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """What TRL passes `from_pretrained` for a reward model given as a path: `model_init_kwargs` (or the caller's
    `model_kwargs`), one label, `float32` unless a dtype is named (transformers' own default would be the config's)."""
    kwargs = dict(args.model_init_kwargs or {}) | dict(model_kwargs or {})
    dtype = kwargs.get("dtype", "float32")
    kwargs["dtype"] = getattr(torch, dtype) if dtype in ("bfloat16", "float16", "float32") else dtype
    kwargs.pop("device_map", None)  # each rank places its own slice
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    return kwargs | {"num_labels": 1}


class ParallelRewardTrainer(ParallelTrainerMixin, RewardTrainer):
    """TRL's `RewardTrainer` on a parallel model (docs/module_notes.md); `args` is a `ParallelRewardConfig`,
    `model` a sequence-classification model or a checkpoint path (a causal LM's gets a new one-label head)."""

    pipeline_columns = ("chosen_ids", "rejected_ids", "margin")  # under pp TRL's collator makes the batches

    def __init__(
        self,
        model: PreTrainedModel | str | os.PathLike,
        args: ParallelRewardConfig | None = None,
        *,
        model_kwargs: dict[str, Any] | None = None,
        quantization_config: Any = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(args, ParallelRewardConfig):
            raise TypeError(f"ParallelRewardTrainer needs ParallelRewardConfig arguments, got {type(args).__name__}")
        check_reward_options(args, quantization_config)
        if isinstance(model, (str, os.PathLike)):
            model_kwargs = reward_model_kwargs(args, model_kwargs)
        set_seed(args.seed)  # as TRL, before the model is built: a new head is drawn from the same numbers
        with suppress_seqcls_warning():
            super().__init__(
                model, args, model_class=AutoModelForSequenceClassification, model_kwargs=model_kwargs, **kwargs
            )
        self._tp_size = self.get_tp_size()  # TRL divides its token count over the world by this
        self._scores: _PipelineScores | None = None
        if self._pipeline is not None:
            root = plan_root(self.model)
            self._scores = root.forward = _PipelineScores(root)

    def training_step(self, model, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        """Under pp, two passes: TRL's loss and metrics from the pooled scores the pipeline computes without a graph,
        backpropagated to those scores only; then the pipeline's forward and backward of sum(row weight x pooled
        score), the weights being that gradient: the parameters get the gradient of TRL's loss."""
        if self._pipeline is None:
            return super().training_step(model, inputs, num_items_in_batch)
        with self.maybe_activation_offload_context:  # as TRL's step
            return self._two_pass_step(model, self._prepare_inputs(inputs), num_items_in_batch)

    def _two_pass_step(self, model, inputs: dict[str, Any], num_items_in_batch) -> torch.Tensor:
        model.train()
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        scaled = getattr(self, "loss_is_scaled_for_ga", None)  # as the Trainer's own step decides it
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
                self.compute_loss_func is not None
            )
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        (weights,) = torch.autograd.grad(loss, self._scores.pooled)
        self._scores.pooled = None
        root = plan_root(model)
        surrogate = _WeightedScores(weights)
        with surrogate_loss(root, surrogate), self.accelerator.autocast():
            model.run_train(
                input_ids=inputs["input_ids"],
                labels=surrogate.labels(root, inputs["input_ids"]),
                attention_mask=inputs.get("attention_mask"),
            )
        return loss.detach()

    def prediction_step(self, model, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys=None):
        """TRL's (its loss and metrics); under pp the pooled scores come through the pipeline (`_PipelineScores`)."""
        if self._pipeline is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        return RewardTrainer.prediction_step(self, model, inputs, prediction_loss_only, ignore_keys)


class _PipelineScores:
    """`forward` of a pipeline-parallel reward model: the pipeline's forward without a graph, every position's score
    on the last stage, each row's pooled there as transformers pools it (its last token that is not the pad token) and
    sent to every stage. In training the pooled scores are a leaf (`pooled`) whose gradient, once TRL's loss is
    backpropagated to it, weighs each row in the pipeline's own backward (`ParallelRewardTrainer.training_step`)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.pooled: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any):
        pipeline = parallel_state(self.model).pipeline
        scores = pipeline.run_eval(input_ids=input_ids, attention_mask=attention_mask).logits
        batch, length = input_ids.shape
        pooled = torch.zeros(batch, self.model.config.num_labels, device=input_ids.device)
        if pipeline.holds_last:
            positions = pooled_positions(self.model, input_ids, batch, length, input_ids.device)
            pooled = scores[torch.arange(batch, device=input_ids.device), positions].float()
        dist.broadcast(pooled, src=pipeline.last_rank, group=pipeline.pp_group)
        if torch.is_grad_enabled():
            self.pooled = pooled.requires_grad_()
        return SequenceClassifierOutputWithPast(logits=pooled)


class _WeightedScores:
    """The loss the pipeline backpropagates under pp: sum over rows of weight x pooled score, each micro-batch's share
    on the last stage. Its labels mark each row's pooled position with the row's number in the batch (`labels`), so
    every share finds its rows' positions and weights."""

    def __init__(self, weights: torch.Tensor) -> None:
        self.weights = weights

    def labels(self, model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        batch, length = input_ids.shape
        rows = torch.arange(batch, device=input_ids.device)
        positions = pooled_positions(model, input_ids, batch, length, input_ids.device)
        marks = torch.full_like(input_ids, IGNORE_INDEX)
        marks[rows, positions] = rows
        return marks

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        marked = labels != IGNORE_INDEX  # one position a row
        return (logits[marked].float() * self.weights.to(logits.device)[labels[marked]]).sum()


check_overrides(ParallelRewardTrainer, RewardTrainer)
