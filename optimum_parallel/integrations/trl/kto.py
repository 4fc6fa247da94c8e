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
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, PreTrainedModel, set_seed
from trl import KTOConfig, KTOTrainer

from ...plan.wrappers import plan_root
from ..transformers.internals import check_overrides, private_override
from ..transformers.trainer import ParallelTrainerMixin
from ..transformers.training_args import ParallelTrainingArguments
from .dpo import ParallelDPOTrainer, _is_peft, check_text_only
from .fused_head import install_fused_head


@dataclass
class ParallelKTOConfig(KTOConfig, ParallelTrainingArguments):
    """TRL's `KTOConfig` plus the mesh and parallelism settings of `ParallelTrainingArguments`; `KTOConfig` first, so
    TRL's defaults (learning rate, sequential sampling, bf16, ...) win over `TrainingArguments`' own."""


def check_kto_options(args: KTOConfig, kwargs: dict[str, Any] | None = None) -> None:
    """ValueError naming the first TRL option that cannot work on the layout `args` asks for (with the trainer's
    keyword arguments `kwargs`: a multimodal processor or image rows, as DPO's `check_text_only`)."""
    check_text_only("ParallelKTOTrainer", kwargs or {})
    if args.pipeline_parallel_size > 1 and args.context_parallel_size > 1:
        raise ValueError(
            f"pipeline_parallel_size={args.pipeline_parallel_size} with context_parallel_size="
            f"{args.context_parallel_size} is not supported by ParallelKTOTrainer (the pipeline's log-probabilities "
            "are scored on whole rows); allowed with pp > 1: context_parallel_size=1"
        )
    if args.use_liger_kernel:
        raise ValueError(
            "use_liger_kernel=True is not supported by ParallelKTOTrainer (Liger's kernels replace the modules the "
            "parallel layout is built on); allowed: False"
        )
    if args.sync_ref_model:
        raise ValueError(
            "sync_ref_model=True is not supported by ParallelKTOTrainer (the policy's data-parallel shards and the "
            "reference's parameters are laid out differently); allowed: False"
        )


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
        if ref_model is not None and ref_model is model:
            raise ValueError("`model` and `ref_model` cannot be the same object; omit `ref_model` for a copy")
        if ref_model is None and not (args.precompute_ref_log_probs or kwargs.get("peft_config") or _is_peft(model)):
            ref_model = model if isinstance(model, (str, os.PathLike)) else model.config._name_or_path
            if not ref_model:
                raise ValueError(
                    "ref_model: the policy was given as a model without a checkpoint path (config._name_or_path is "
                    "empty); pass ref_model (a model or a checkpoint path) or precompute_ref_log_probs=True"
                )
        if ref_model is not None:  # DPO's: lazily loaded, parallel on the policy's mesh, frozen
            kwargs_for_ref = dict(model_kwargs or {})
            if isinstance(model, PreTrainedModel):
                kwargs_for_ref.setdefault("dtype", model.dtype)
            ref_model = ParallelDPOTrainer._parallel_reference(self, ref_model, args, model_class, kwargs_for_ref)
        set_seed(args.seed)  # as TRL, before the policy is built: a PEFT adapter's init draws the same numbers
        super().__init__(model, args, model_class=model_class, model_kwargs=model_kwargs, ref_model=ref_model, **kwargs)
        if self.aux_loss_enabled:
            raise ValueError(
                f"router_aux_loss_coef={self.router_aux_loss_coef} is not supported by ParallelKTOTrainer (the "
                "parallel fused head computes no router aux loss); allowed: router_aux_loss_coef=0.0"
            )
        self._install_fused_heads()
        self._tp_size = self.get_tp_size()  # TRL divides its token count over the world by this

    def _install_fused_heads(self) -> None:
        """The parallel fused head on the policy (its base under PEFT) and the reference, where TRL put its own;
        `_policy_head` is what DPO's pipeline step reads."""
        policy = self.model.get_base_model() if _is_peft(self.model) else self.model
        self._policy_head = install_fused_head(plan_root(policy))
        if self.ref_model is not None:
            install_fused_head(plan_root(self.ref_model))

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
        from datasets import IterableDataset

        if isinstance(dataset, IterableDataset):
            raise ValueError(
                "`precompute_ref_log_probs=True` is not supported with IterableDataset. Please use a map-style "
                "Dataset or set `precompute_ref_log_probs=False`."
            )
        self._install_fused_heads()  # called from TRL's __init__, before ours installed them
        loader = DataLoader(dataset, batch_size=batch_size, collate_fn=self.data_collator, shuffle=False)
        model = self.ref_model or self.model
        logps, kl_logps = [], []
        for batch in loader:
            batch = {k: v.to(self.args.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            ref_logps, ref_kl_logps = self.compute_ref_log_probs(model, batch)
            logps.append(ref_logps.float().cpu())
            if ref_kl_logps is not None:
                kl_logps.append(ref_kl_logps.float().cpu())
        dataset = dataset.add_column("ref_logps", torch.cat(logps).tolist())
        return dataset.add_column("ref_KL_logps", torch.cat(kl_logps).tolist()) if kl_logps else dataset


check_overrides(ParallelKTOTrainer, KTOTrainer)
