"""TRL's `DPOTrainer` with `ParallelTrainerMixin` (`ParallelDPOTrainer`, `ParallelDPOConfig`): preference
optimisation on a tp / sp / cp / pp / dp (sharding levels 0-3) mesh, equal to TRL's `DPOTrainer` on one process. The
policy and the reference are both parallel on the same mesh, their per-token log-probabilities from the parallel fused
head (`fused_head.py`); `check_dpo_options`, `check_text_only` and `check_preference_dataset` refuse what cannot run
before anything changes. Design notes: docs/module_notes.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, set_seed
from trl import DPOConfig, DPOTrainer, KTOConfig

from ...engine.checks import validate
from ...engine.compose import compose_model
from ...frontends.family_request import family_request
from ...frontends.manager import ParallelizersManager
from ...plan.wrappers import plan_root
from ...tensor_parallel.logprobs import IGNORE_INDEX, token_log_probs, vocab_slice
from ..transformers.internals import check_overrides, private_override
from ..transformers.lazy_loading import lazy_load_for_parallelism
from ..transformers.trainer import ParallelTrainerMixin, _mesh_for
from ..transformers.training_args import ParallelTrainingArguments, trainer_request
from .fused_head import FusedHead, install_fused_head
from .pipeline_pass import check_whole_rows, surrogate_loss


@dataclass
class ParallelDPOConfig(DPOConfig, ParallelTrainingArguments):
    """TRL's `DPOConfig` plus the mesh and parallelism settings of `ParallelTrainingArguments`; `DPOConfig` first, so
    TRL's defaults (learning rate, bf16, logging_steps, ...) win over `TrainingArguments`' own, as with TRL alone."""


def check_text_only(trainer: str, kwargs: dict[str, Any]) -> None:
    """ValueError, on every rank before anything loads, for TRL's vision-language path: a multimodal processor as
    `processing_class` or image rows (`image` / `images`) in `train_dataset`. TRL then collates pixel values and
    image grids with each batch, a path not shown to give TRL's figures on a parallel policy (its reference is
    loaded with `model_class`, a causal LM by default; the pipeline's columns carry no images): refused, rather
    than trained to figures that may differ."""
    from transformers import ProcessorMixin

    processor = kwargs.get("processing_class")
    if isinstance(processor, ProcessorMixin):
        raise ValueError(
            f"processing_class={type(processor).__name__} (a multimodal processor: a vision-language policy's "
            f"images) is not supported by {trainer}; allowed: a tokenizer (text-only policies and rows)"
        )
    dataset = kwargs.get("train_dataset")
    first = next(iter(dataset), None) if dataset is not None else None
    for key in ("image", "images"):
        if isinstance(first, dict) and key in first:
            raise ValueError(
                f"train_dataset with an {key!r} column (vision-language rows) is not supported by {trainer}; "
                "allowed: text-only rows"
            )


def check_dpo_options(args: DPOConfig, kwargs: dict[str, Any] | None = None) -> None:
    """ValueError naming the first TRL option that cannot work on the layout `args` asks for (with the trainer's
    keyword arguments `kwargs`: a multimodal processor or image rows, `check_text_only`)."""
    check_reference_trainer_options("ParallelDPOTrainer", args, kwargs)


def check_reference_trainer_options(trainer: str, args: DPOConfig | KTOConfig, kwargs: dict[str, Any] | None) -> None:
    """The refusals DPO and KTO share, in order, naming `trainer` (`check_dpo_options`, `check_kto_options`)."""
    check_text_only(trainer, kwargs or {})
    check_whole_rows(args, trainer, "the pipeline's log-probabilities are scored on whole rows")
    if args.use_liger_kernel:
        raise ValueError(
            f"use_liger_kernel=True is not supported by {trainer} (Liger's kernels replace the modules the "
            "parallel layout is built on); allowed: False"
        )
    if args.sync_ref_model:
        raise ValueError(
            f"sync_ref_model=True is not supported by {trainer} (the policy's data-parallel shards and the "
            "reference's parameters are laid out differently); allowed: False"
        )


def check_preference_dataset(dataset: Any) -> None:
    """TRL's preparation of a preference dataset reads `chosen` and `rejected` (after extracting the prompt when
    there is none): its error, raised here on every rank, before TRL's rank-0-first preparation (where the other
    ranks would wait for rank 0 at a barrier it never reaches)."""
    from trl.data_utils import extract_prompt

    first = next(iter(dataset), None)
    if first is None or "prompt_ids" in first:
        return
    if "prompt" not in first:
        first = extract_prompt(first)  # TRL's own function: its KeyError for a missing chosen / rejected
    for key in ("chosen", "rejected"):
        if key not in first:
            raise KeyError(
                f"{key!r}: a preference dataset needs the columns 'chosen' and 'rejected' (and 'prompt', or a "
                f"prompt shared by both); got {sorted(first)}"
            )


class _BaseAsReference(torch.nn.Module):
    """Stands for the reference while TRL's `DPOTrainer.__init__` runs, when the mixin (not TRL) made the PEFT model
    from `peft_config`: TRL would otherwise take the policy for a pretrained adapter and copy it as the reference
    ("ref" adapter), where with `peft_config` its reference is the base model, adapters disabled. Removed after."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config

    def forward(self, *args, **kwargs):
        raise RuntimeError("the placeholder reference of ParallelDPOTrainer was called")


def _is_peft(model: Any) -> bool:
    from accelerate.utils import is_peft_model

    return isinstance(model, torch.nn.Module) and is_peft_model(model)


class ParallelDPOTrainer(ParallelTrainerMixin, DPOTrainer):
    """TRL's `DPOTrainer` on a parallel model (docs/module_notes.md); `args` is a `ParallelDPOConfig`, `model` a
    transformers model or a checkpoint path, `ref_model` None (the policy's checkpoint), a model or a path."""

    # under pp the dataset keeps TRL's columns (the collator makes the batches)
    pipeline_columns = ("prompt_ids", "chosen_ids", "rejected_ids", "ref_chosen_logps", "ref_rejected_logps")

    def __init__(
        self,
        model: PreTrainedModel | str | os.PathLike,
        ref_model: PreTrainedModel | str | os.PathLike | None = None,
        args: ParallelDPOConfig | None = None,
        *,
        model_class: type = AutoModelForCausalLM,
        model_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(args, ParallelDPOConfig):
            raise TypeError(f"ParallelDPOTrainer needs ParallelDPOConfig arguments, got {type(args).__name__}")
        check_dpo_options(args, kwargs)
        if kwargs.get("train_dataset") is None:
            raise ValueError("`train_dataset` is required")
        check_preference_dataset(kwargs["train_dataset"])
        base_as_reference = ref_model is None and kwargs.get("peft_config") is not None
        ref_model = reference_for(model, ref_model, args, model_class, model_kwargs, kwargs)
        if base_as_reference:
            config = model.config if isinstance(model, PreTrainedModel) else AutoConfig.from_pretrained(model)
            ref_model = _BaseAsReference(config)
        set_seed(args.seed)  # as TRL, before the policy is built: a PEFT adapter's init draws the same numbers
        super().__init__(model, args, model_class=model_class, model_kwargs=model_kwargs, ref_model=ref_model, **kwargs)
        if isinstance(self.ref_model, _BaseAsReference):
            self.ref_model = None
        finish_reference_trainer(self, "ParallelDPOTrainer")

    def _install_fused_heads(self) -> None:
        """The parallel fused head on the policy (its base under PEFT) and the reference, where TRL put its own."""
        policy = self.model.get_base_model() if _is_peft(self.model) else self.model
        self._policy_head: FusedHead = install_fused_head(plan_root(policy))
        if self.ref_model is not None and not isinstance(self.ref_model, _BaseAsReference):
            install_fused_head(plan_root(self.ref_model))

    def training_step(self, model, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        """Under pp, two passes: TRL's loss and metrics from log-probabilities the pipeline computes without a graph
        (its forward, scored on the last stage, sent to every stage), backpropagated to those log-probabilities only;
        then the pipeline's forward and backward of sum(token weight x log p), the weights being that gradient: the
        parameters get the gradient of TRL's loss, for every loss type (it is computed on the whole batch)."""
        if self._pipeline is None:
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs) / self.current_gradient_accumulation_steps
        leaf = self._policy_head.pipeline_log_probs
        (weights,) = torch.autograd.grad(loss, leaf)
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, IGNORE_INDEX)
        root = plan_root(model)
        vocab = root.config.get_text_config().vocab_size
        surrogate = _WeightedLogProbs(root, weights, vocab)
        with surrogate_loss(root, surrogate), self.accelerator.autocast():
            model.run_train(
                input_ids=inputs["input_ids"],
                labels=surrogate.encode(labels),
                attention_mask=inputs.get("attention_mask"),
            )
        return loss.detach()

    def prediction_step(self, model, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys=None):
        """TRL's (the DPO loss and metrics); under pp its fused forward runs through the pipeline."""
        if self._pipeline is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        return DPOTrainer.prediction_step(self, model, inputs, prediction_loss_only, ignore_keys)

    @private_override
    def _precompute_ref_logps(self, dataset, name: str, batch_size: int):
        """The reference's log-probabilities of every row, added as columns (TRL's columns). Every rank runs every
        batch in order (the tp / cp ranks of a batch run its collectives together), so no rank waits on another's
        data; TRL's cache file is not written."""
        chosen, rejected = [], []
        for ref_chosen, ref_rejected in reference_log_probs(self, dataset, batch_size):
            chosen.append(ref_chosen.float().cpu())
            rejected.append(ref_rejected.float().cpu())
        dataset = dataset.add_column("ref_chosen_logps", torch.cat(chosen).tolist())
        return dataset.add_column("ref_rejected_logps", torch.cat(rejected).tolist())


def parallel_reference(
    ref: PreTrainedModel | str | os.PathLike, args: ParallelTrainingArguments, model_class: type, kwargs: dict
) -> PreTrainedModel:
    """The reference on the policy's mesh (tp / sp / cp; replicated over dp), frozen; from a path, each rank
    reads its slice only (DPO's and KTO's reference, distillation's teacher)."""
    request = trainer_request(args, device=args.device)
    mesh = _mesh_for(request, args.ddp_timeout)
    if isinstance(ref, (str, os.PathLike)):
        sizes = args.tensor_parallel_size, args.pipeline_parallel_size, args.expert_parallel_size
        with lazy_load_for_parallelism(*sizes):
            ref = model_class.from_pretrained(ref, **kwargs)
    inner = plan_root(ref)
    family = ParallelizersManager.parallelizer_for_model(ref)
    checked = validate(replace(request, optimizer=None), inner, mesh, partial(family_request, family))
    compose_model(inner, mesh, checked)
    ref.requires_grad_(False)
    return ref.eval()


def reference_for(
    model: PreTrainedModel | str | os.PathLike,
    ref_model: PreTrainedModel | str | os.PathLike | None,
    args: DPOConfig | KTOConfig,
    model_class: type,
    model_kwargs: dict[str, Any] | None,
    kwargs: dict[str, Any],
) -> PreTrainedModel | None:
    """DPO's and KTO's reference: `ref_model` or the policy's checkpoint (none with precomputed log-probs or PEFT)."""
    if ref_model is not None and ref_model is model:
        raise ValueError("`model` and `ref_model` cannot be the same object; omit `ref_model` for a copy")
    if ref_model is None and not (args.precompute_ref_log_probs or kwargs.get("peft_config") or _is_peft(model)):
        ref_model = model if isinstance(model, (str, os.PathLike)) else model.config._name_or_path
        if not ref_model:
            raise ValueError(
                "ref_model: the policy was given as a model without a checkpoint path (config._name_or_path is "
                "empty); pass ref_model (a model or a checkpoint path) or precompute_ref_log_probs=True"
            )
    if ref_model is not None:
        kwargs_for_ref = dict(model_kwargs or {})
        if isinstance(model, PreTrainedModel):
            kwargs_for_ref.setdefault("dtype", model.dtype)
        ref_model = parallel_reference(ref_model, args, model_class, kwargs_for_ref)
    return ref_model


def finish_reference_trainer(trainer: ParallelTrainerMixin, name: str) -> None:
    """DPO's and KTO's steps after TRL's `__init__`: no router aux loss, the fused heads installed, the tp size kept."""
    if trainer.aux_loss_enabled:
        raise ValueError(
            f"router_aux_loss_coef={trainer.router_aux_loss_coef} is not supported by {name} (the "
            "parallel fused head computes no router aux loss); allowed: router_aux_loss_coef=0.0"
        )
    trainer._install_fused_heads()
    trainer._tp_size = trainer.get_tp_size()  # TRL divides its token count over the world by this


def reference_log_probs(trainer: ParallelTrainerMixin, dataset, batch_size: int) -> Iterator[tuple]:
    """TRL's `compute_ref_log_probs` of each batch of `dataset`, in order, on every rank (DPO's, KTO's precompute)."""
    from datasets import IterableDataset

    if isinstance(dataset, IterableDataset):
        raise ValueError(
            "`precompute_ref_log_probs=True` is not supported with IterableDataset. Please use a map-style "
            "Dataset or set `precompute_ref_log_probs=False`."
        )
    trainer._install_fused_heads()  # called from TRL's __init__, before ours installed them
    if isinstance(trainer.ref_model, _BaseAsReference):
        trainer.ref_model = None  # the base, adapters disabled (TRL's `compute_ref_log_probs` reads this)
    loader = DataLoader(dataset, batch_size=batch_size, collate_fn=trainer.data_collator, shuffle=False)
    model = trainer.ref_model or trainer.model
    for batch in loader:
        batch = {k: v.to(trainer.args.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        yield trainer.compute_ref_log_probs(model, batch)


class _WeightedLogProbs:
    """The loss the pipeline backpropagates under pp: sum over tokens of weight x log p(label), each micro-batch's
    share on the last stage. The labels it is given carry each token's place in the batch (`encode`: label +
    vocab x (flat index + 1)), so every share finds its weights whatever rows its micro-batch holds."""

    def __init__(self, model, weights: torch.Tensor, vocab_size: int) -> None:
        self.model, self.weights, self.vocab_size = model, weights, vocab_size

    def encode(self, labels: torch.Tensor) -> torch.Tensor:
        index = torch.arange(labels.numel(), device=labels.device).view(labels.shape)
        return torch.where(labels == IGNORE_INDEX, labels, labels + self.vocab_size * (index + 1))

    def __call__(self, logits, labels, **kwargs) -> torch.Tensor:
        targets = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        ignored = targets == IGNORE_INDEX
        place = torch.where(ignored, self.vocab_size, targets) // self.vocab_size - 1  # flat index, row-major (B, L)
        length = self.weights.shape[1] + 1
        rows, columns = place // length, (place % length - 1).clamp(min=0)
        weights = self.weights.to(logits.device)[rows.clamp(min=0), columns].masked_fill(ignored, 0.0)
        head = vocab_slice(self.model)
        log_probs = token_log_probs(logits, (targets % self.vocab_size).masked_fill(ignored, IGNORE_INDEX),
                                    head.group, head.vocab_start)  # fmt: skip
        return (log_probs * weights).sum()


check_overrides(ParallelDPOTrainer, DPOTrainer)
