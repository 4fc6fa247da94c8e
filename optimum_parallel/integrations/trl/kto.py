"""TRL's `KTOTrainer` with `ParallelTrainerMixin` (`ParallelKTOTrainer`, `ParallelKTOConfig`): Kahneman-Tversky
optimisation on a tp / sp / cp / pp / dp (sharding levels 0-3) mesh, equal to TRL's `KTOTrainer` on one process. The
parallel pieces are DPO's (`dpo.py`): policy and reference parallel on the same mesh, the parallel fused head, DPO's
two-pass step under pp; `check_kto_options` refuses what cannot run. Design notes: docs/module_notes.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, set_seed
from trl import KTOConfig, KTOTrainer

from ..transformers.internals import check_overrides, private_override
from ..transformers.trainer import ParallelTrainerMixin
from ..transformers.training_args import ParallelTrainingArguments
from .dpo import (
    ParallelDPOTrainer,
    check_reference_trainer_options,
    finish_reference_trainer,
    reference_for,
    reference_log_probs,
)


@dataclass
class ParallelKTOConfig(KTOConfig, ParallelTrainingArguments):
    """TRL's `KTOConfig` plus the mesh and parallelism settings of `ParallelTrainingArguments`; `KTOConfig` first, so
    TRL's defaults (learning rate, sequential sampling, bf16, ...) win over `TrainingArguments`' own."""


def check_kto_options(args: KTOConfig, kwargs: dict[str, Any] | None = None) -> None:
    """ValueError naming the first TRL option that cannot work on the layout `args` asks for (with the trainer's
    keyword arguments `kwargs`: a multimodal processor or image rows, as DPO's `check_text_only`); DPO's refusals."""
    check_reference_trainer_options("ParallelKTOTrainer", args, kwargs)


class ParallelKTOTrainer(ParallelTrainerMixin, KTOTrainer):
    """TRL's `KTOTrainer` on a parallel model (docs/module_notes.md); `args` is a `ParallelKTOConfig`, `model` a
    transformers model or a checkpoint path, `ref_model` None (the policy's checkpoint), a model or a path."""

    # under pp the dataset keeps TRL's columns (the collator makes the batches)
    pipeline_columns = ("prompt_ids", "completion_ids", "KL_completion_ids", "label", "ref_logps", "ref_KL_logps")

    def __init__(
        self,
        model: PreTrainedModel | str | os.PathLike,
        ref_model: PreTrainedModel | str | os.PathLike | None = None,
        args: ParallelKTOConfig | None = None,
        *,
        model_class: type = AutoModelForCausalLM,
        model_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(args, ParallelKTOConfig):
            raise TypeError(f"ParallelKTOTrainer needs ParallelKTOConfig arguments, got {type(args).__name__}")
        check_kto_options(args, kwargs)
        if kwargs.get("train_dataset") is None:
            raise ValueError("`train_dataset` is required")
        # DPO's reference: the policy's checkpoint unless given, lazily loaded, parallel on the policy's mesh, frozen
        ref_model = reference_for(model, ref_model, args, model_class, model_kwargs, kwargs)
        set_seed(args.seed)  # as TRL, before the policy is built: a PEFT adapter's init draws the same numbers
        super().__init__(model, args, model_class=model_class, model_kwargs=model_kwargs, ref_model=ref_model, **kwargs)
        finish_reference_trainer(self, "ParallelKTOTrainer")

    # DPO's: the fused head on the policy (its base under PEFT) and the reference; `_policy_head` is what DPO's
    # pipeline step reads
    _install_fused_heads = ParallelDPOTrainer._install_fused_heads

    def training_step(self, model, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        """TRL's step; under pp DPO's two passes (`ParallelDPOTrainer.training_step`)."""
        if self._pipeline is None:
            return super().training_step(model, inputs, num_items_in_batch)
        with self.maybe_activation_offload_context:
            return ParallelDPOTrainer.training_step(self, model, inputs, num_items_in_batch)

    def prediction_step(self, model, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys=None):
        """TRL's (the KTO loss and metrics); under pp its fused forward runs through the pipeline."""
        if self._pipeline is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        return KTOTrainer.prediction_step(self, model, inputs, prediction_loss_only, ignore_keys)

    @private_override
    def _precompute_ref_logps(self, dataset, name: str, batch_size: int):
        """The reference's log-probabilities of every row (and of its KL completion), added as TRL's columns. Every
        rank runs every batch in order (the ranks of a batch run its collectives together), so no rank waits on
        another's data; TRL's cache file is not written."""
        logps, kl_logps = [], []
        for ref_logps, ref_kl_logps in reference_log_probs(self, dataset, batch_size):
            logps.append(ref_logps.float().cpu())
            if ref_kl_logps is not None:
                kl_logps.append(ref_kl_logps.float().cpu())
        dataset = dataset.add_column("ref_logps", torch.cat(logps).tolist())
        return dataset.add_column("ref_KL_logps", torch.cat(kl_logps).tolist()) if kl_logps else dataset


check_overrides(ParallelKTOTrainer, KTOTrainer)
