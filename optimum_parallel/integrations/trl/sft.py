"""TRL's `SFTTrainer` with `ParallelTrainerMixin` (`ParallelSFTTrainer`, `ParallelSFTConfig`): packing
(`packing=True`, `padding_free=True`) on every layout. The loss is the model's own (vocab-parallel under tp, summed
over cp), TRL's token metrics come from the logits it reads (`metrics.py`), and `check_sft_options` refuses the options
that need TRL's fused LM head or the whole logits on every rank. Design notes: docs/module_notes.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer
from trl import SFTConfig, SFTTrainer

from ...plan.wrappers import plan_root
from ..transformers.internals import check_overrides
from ..transformers.trainer import PIPELINE_COLUMNS, ParallelTrainerMixin
from ..transformers.training_args import ParallelTrainingArguments
from .metrics import TokenMetrics


@dataclass
class ParallelSFTConfig(SFTConfig, ParallelTrainingArguments):
    """TRL's `SFTConfig` plus the mesh and parallelism settings of `ParallelTrainingArguments`; `SFTConfig` first, so
    TRL's defaults (learning rate, bf16, logging_steps, ...) win over `TrainingArguments`' own, as with TRL alone."""


def check_sft_options(args: SFTConfig, compute_loss_func: Any = None) -> None:
    """ValueError naming the first TRL option that cannot work on the layout `args` asks for."""
    split = {"tensor_parallel_size": args.tensor_parallel_size, "context_parallel_size": args.context_parallel_size,
             "pipeline_parallel_size": args.pipeline_parallel_size}  # fmt: skip
    layout = ", ".join(f"{k}={v}" for k, v in split.items() if v > 1)
    if args.loss_type != "nll":
        raise ValueError(
            f"loss_type={args.loss_type!r} is not supported by ParallelSFTTrainer (it needs TRL's fused LM head, "
            "which reads the whole vocabulary and the whole row on one rank); allowed: 'nll'"
        )
    if args.use_liger_kernel:
        raise ValueError(
            "use_liger_kernel=True is not supported by ParallelSFTTrainer (Liger's kernels replace the modules and "
            "the forward the parallel layout is built on); allowed: False"
        )
    if layout and compute_loss_func is not None:
        raise ValueError(
            f"compute_loss_func is not supported with {layout}: the logits it would receive are a shard of the "
            "vocabulary (tp), of the sequence (cp) or absent (pp); allowed there: None (the model's own loss)"
        )
    if layout and args.label_smoothing_factor > 0:
        raise ValueError(
            f"label_smoothing_factor={args.label_smoothing_factor} is not supported with {layout}: it needs the whole "
            "logits on every rank; allowed there: 0"
        )


def _check_router_loss(trainer: SFTTrainer, args: SFTConfig) -> None:
    """TRL turns `output_router_logits` on for a MoE model when its coefficient is not 0; the pipeline's loss has no
    router aux loss, so under pp that would be dropped without a word."""
    config = trainer.model.config.get_text_config()
    if args.pipeline_parallel_size > 1 and getattr(config, "output_router_logits", False):
        raise ValueError(
            f"router_aux_loss_coef={trainer.router_aux_loss_coef} with pipeline_parallel_size="
            f"{args.pipeline_parallel_size} is not supported (the pipeline's loss has no router aux loss); allowed "
            "with pp > 1: router_aux_loss_coef=0.0"
        )


class ParallelSFTTrainer(ParallelTrainerMixin, SFTTrainer):
    """TRL's `SFTTrainer` on a parallel model (docs/module_notes.md); `args` is a `ParallelSFTConfig`."""

    pipeline_columns = (*PIPELINE_COLUMNS, "seq_lengths")  # TRL's packed datasets: the documents' lengths

    def __init__(self, model, args: ParallelSFTConfig, **kwargs: Any) -> None:
        if not isinstance(args, ParallelSFTConfig):
            raise TypeError(f"ParallelSFTTrainer needs ParallelSFTConfig arguments, got {type(args).__name__}")
        check_sft_options(args, kwargs.get("compute_loss_func"))
        super().__init__(model, args, **kwargs)
        _check_router_loss(self, args)
        self._token_metrics = TokenMetrics.install(plan_root(self.model))

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """The model's own loss (docs/module_notes.md), without a key/value cache; TRL's token metrics from its
        logits."""
        inputs["use_cache"] = False
        with self._recording():
            result = Trainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
        self._log_token_metrics("train" if self.model.training else "eval", inputs)
        return result

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Under pp the pipeline runs the step (no `compute_loss`): the metrics are read after it."""
        if self._pipeline is None:
            return super().training_step(model, inputs, num_items_in_batch)
        with self._recording():
            loss = super().training_step(model, inputs, num_items_in_batch)
        self._log_token_metrics("train", inputs)
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys=None):
        """Under pp the pipeline runs the evaluation forward (no `compute_loss`): the metrics are read after it."""
        if self._pipeline is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        with self._recording():
            result = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        self._log_token_metrics("eval", inputs)
        return result

    @contextlib.contextmanager
    def _recording(self):
        self._token_metrics.recording = True
        try:
            yield
        finally:
            self._token_metrics.recording = False

    def _log_token_metrics(self, mode: str, inputs: dict[str, Any]) -> None:
        """TRL's `entropy`, `mean_token_accuracy` and `num_tokens` (of the whole batch: the dp replicas' counts
        added, each replica's tp / pp / cp ranks counted once)."""
        last = None if self._pipeline is None else self._pipeline.num_microbatches  # one loss call each
        found = self._token_metrics.collect(self.mesh, self.args.device, last)
        entropy, accuracy = found if found is not None else (0.0, 0.0)
        self._metrics[mode]["entropy"].append(entropy)
        self._metrics[mode]["mean_token_accuracy"].append(accuracy)
        if mode == "train":
            if inputs.get("attention_mask") is not None:
                tokens = inputs["attention_mask"].sum()
            else:  # padding-free: one row of real tokens
                tokens = torch.tensor(inputs["position_ids"].size(1))
            tokens = tokens.to(self.args.device)
            if self.mesh.size("batch") > 1:
                dist.all_reduce(tokens, group=self.mesh.group("batch"))
            self._total_train_tokens += int(tokens.item())
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]


check_overrides(ParallelSFTTrainer, SFTTrainer)
