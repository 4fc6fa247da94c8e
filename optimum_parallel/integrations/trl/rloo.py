"""TRL's `RLOOTrainer` with `ParallelTrainerMixin` (`ParallelRLOOTrainer`, `ParallelRLOOConfig`): completions
generated, scored and trained on by the parallel model on a tp / sp / cp / pp / dp mesh (sharding levels 0-3), equal
to TRL's `RLOOTrainer` on one process. It reuses GRPO's parallel pieces (`grpo.py`), TRL's gathers run over the batch
replicas, and `check_rloo_options` refuses by name what a layout cannot run. Design notes: docs/module_notes.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from transformers import ProcessorMixin, set_seed
from trl import RLOOConfig, RLOOTrainer
from trl.trainer import rloo_trainer as trl_rloo

from ...plan import logits_mode
from ...plan.wrappers import plan_root
from ...tensor_parallel.logprobs import IGNORE_INDEX
from ...tensor_parallel.random import share_rng_states
from ..transformers.internals import InternalsChanged, check_overrides, private_override
from ..transformers.trainer import ParallelTrainerMixin
from ..transformers.training_args import ParallelTrainingArguments
from .fused_head import FusedHead, install_fused_head
from .grpo import (
    ParallelGRPOConfig,
    ParallelGRPOTrainer,
    _generate_without_cache,
    _size_generation_batch,
    _vocab_parallel_head,
    tempered_pipeline_pass,
)
from .replicas import ReplicaView, over_replicas, swapped_globals

TRL_MODULE_GLOBALS = ("gather", "gather_object", "create_model_from_path", "use_adapter")  # `swapped_globals`
for _name in TRL_MODULE_GLOBALS:
    if not callable(getattr(trl_rloo, _name, None)):
        raise InternalsChanged(
            f"trl.trainer.rloo_trainer.{_name} no longer exists; ParallelRLOOTrainer swaps it (see the module "
            "docstring). Install a TRL version this release supports."
        )


@dataclass
class ParallelRLOOConfig(RLOOConfig, ParallelTrainingArguments):
    """TRL's `RLOOConfig` plus the mesh settings of `ParallelTrainingArguments` (`RLOOConfig` first: TRL's defaults
    win); the generation batch is counted in batch replicas (world / (tp * pp * cp)), as TRL counts processes."""

    def __post_init__(self) -> None:
        asked = self.generation_batch_size, self.steps_per_generation
        super().__post_init__()  # TRL sized the generation batch with world_size processes: sized again below
        self.generation_batch_size, self.steps_per_generation = asked
        _size_generation_batch(self, max(1, self.world_size // self.ranks_per_replica))

    ranks_per_replica = ParallelGRPOConfig.ranks_per_replica


def check_rloo_options(args: ParallelRLOOConfig, kwargs: dict[str, Any]) -> None:
    """ValueError naming the first RLOO option the layout `args` asks for cannot run (the list and the reasons:
    docs/module_notes.md)."""
    if args.pipeline_parallel_size > 1 and args.context_parallel_size > 1:
        raise ValueError(
            f"pipeline_parallel_size={args.pipeline_parallel_size} with context_parallel_size="
            f"{args.context_parallel_size} is not supported by ParallelRLOOTrainer (the pipeline scores and generates "
            "on whole rows); allowed with pp > 1: context_parallel_size=1"
        )
    flags = {
        "use_vllm": "vLLM generates outside the parallel model",
        "use_transformers_continuous_batching": "generate_batch is not synchronised over the tp ranks",
        "use_liger_kernel": "Liger's kernels replace the forward the parallel layout is built on",
    }
    for name, why in flags.items():
        if getattr(args, name, False):
            raise ValueError(f"{name}=True is not supported by ParallelRLOOTrainer ({why}); allowed: False")
    if args.sync_ref_model and args.sharding_level >= 2:
        raise ValueError(
            f"sync_ref_model=True is not supported with sharding_level={args.sharding_level} (FSDP2 shards the "
            "policy's parameters over dp, the reference's are whole, and TRL's callback mixes them element by "
            "element); allowed there: sync_ref_model=False, or sharding_level 0-1"
        )
    if isinstance(kwargs.get("processing_class"), ProcessorMixin):
        raise ValueError(
            f"processing_class={type(kwargs['processing_class']).__name__} (a multimodal processor) is not supported "
            "by ParallelRLOOTrainer; allowed: a tokenizer (text-only policies)"
        )


class ParallelRLOOTrainer(ParallelTrainerMixin, RLOOTrainer):
    """TRL's `RLOOTrainer` on a parallel model (docs/module_notes.md); `args` is a `ParallelRLOOConfig`.

    `ParallelRLOOTrainer(model_or_path, reward_funcs=..., args=ParallelRLOOConfig(...), train_dataset=...,
    processing_class=tokenizer)`; launch with torchrun.
    """

    # under pp the dataset keeps TRL's columns (TRL generates from the prompts), not the pipeline's input columns
    pipeline_columns = ("prompt", "image", "images")

    def __init__(self, model, reward_funcs=None, args: ParallelRLOOConfig | None = None, **kwargs: Any) -> None:
        if not isinstance(args, ParallelRLOOConfig):
            raise TypeError(f"ParallelRLOOTrainer needs ParallelRLOOConfig arguments, got {type(args).__name__}")
        check_rloo_options(args, kwargs)
        set_seed(args.seed)  # as TRL seeds before it builds the model: adapters (peft_config) start as TRL's do
        # the reference (beta > 0) as GRPO's: lazily loaded, parallel on the policy's mesh
        load_reference = ParallelGRPOTrainer._load_reference.__get__(self)
        with swapped_globals(trl_rloo, {"create_model_from_path": load_reference}):
            super().__init__(model, args=args, reward_funcs=reward_funcs, **kwargs)
        if self.aux_loss_enabled:
            raise ValueError(
                f"router_aux_loss_coef={self.router_aux_loss_coef} is not supported by ParallelRLOOTrainer (the "
                "parallel fused head computes no router aux loss); allowed: 0.0"
            )
        self._policy_head: FusedHead | None = None  # under pp: its leaf of log-probs weighs `training_step`'s pass
        self._pipeline_pass: tuple[torch.Tensor, ...] | None = None  # under pp: the step's rows (`compute_loss`)
        for scorer in (self.model, self.ref_model):  # TRL's fused heads, replaced by the parallel one
            if scorer is not None:
                unwrapped = self.accelerator.unwrap_model(scorer)
                base = unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped
                head = install_fused_head(plan_root(base), self.temperature)
                self._policy_head = self._policy_head or head
        # TRL seeded every process apart (seed + process index): the ranks of a replica sample, shuffle and draw
        # alike, so they share seed + replica index (one process: the seed TRL gives process 0)
        set_seed(args.seed + self.mesh.rank("batch"))
        share_rng_states(self.mesh.group("peers"))

    def _over_replicas(self):
        """TRL's gathers and reductions over the batch replicas for the block (`replicas.over_replicas`)."""
        return over_replicas(self, trl_rloo)

    @private_override
    def _prepare_inputs(self, generation_batch):
        """TRL's generation, scoring and buffering, with the replicas as its processes."""
        with self._over_replicas():
            return super()._prepare_inputs(generation_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's clipped per-sequence loss and its metrics, with the replicas as its processes. Under pp, in training,
        the rows TRL scores (prompt and completion, the completion's tokens labelled) are kept for `training_step`."""
        if self._pipeline is not None and torch.is_grad_enabled():
            input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
            labels[:, : inputs["prompt_ids"].size(1)] = IGNORE_INDEX
            self._pipeline_pass = input_ids, attention_mask, labels
        with self._over_replicas():
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """Under pp, DPO's two passes (as `ParallelGRPOTrainer.training_step`): TRL's step, whose log-probs the
        pipeline scored without a graph (a leaf, `FusedHead.pipeline_log_probs`), backpropagates TRL's loss to them;
        then the pipeline's forward and backward of sum(weight x log p(token)), the weights being that gradient and
        the logits divided by the temperature, give the parameters the gradient of TRL's loss."""
        if self._pipeline is None:
            return super().training_step(model, inputs, num_items_in_batch)
        self._pipeline_pass = None
        loss = RLOOTrainer.training_step(self, model, inputs, num_items_in_batch)  # TRL's, backward to the leaf
        tempered_pipeline_pass(self, model)
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """TRL's evaluation loss, the mean of the replicas' (each the mean over its sequences), on every replica;
        under pp TRL's own, its scoring through the pipeline (the Trainer's pp evaluation scores labels of its own)."""
        if self._pipeline is None:
            loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        else:
            loss, logits, labels = RLOOTrainer.prediction_step(self, model, inputs, prediction_loss_only, ignore_keys)
        if loss is not None and self.mesh.size("batch") > 1:
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=self.mesh.group("batch"))
            loss = loss / self.mesh.size("batch")
        return loss, logits, labels

    @private_override
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
        """TRL's generation through the parallel model's tp-synchronised `generate`, sampling from full-vocabulary
        logits even inside an evaluation that keeps them local; under cp and pp without a kv cache (under pp through
        the pipeline's stages)."""
        full = _vocab_parallel_head(self.model) is not None
        without_cache = self.mesh.size("cp") > 1 or self._pipeline is not None
        with (
            logits_mode(self.model, "full") if full else contextlib.nullcontext(),
            _generate_without_cache(self.accelerator.unwrap_model(self.model), self.mesh, self._pipeline)
            if without_cache
            else contextlib.nullcontext(),
        ):
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields)

    @private_override
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards of this replica's completions (every rank of the replica runs the functions), the replica's
        first rank's sent to its other ranks, then gathered over the replicas (TRL's `gather`, swapped)."""
        with swapped_globals(trl_rloo, {"gather": lambda tensor: tensor}):
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self.mesh.size("peers") > 1:
            group = self.mesh.group("peers")
            dist.broadcast(rewards, src=dist.get_global_rank(group, 0), group=group)
        view = self.accelerator
        return view.gather(rewards) if isinstance(view, ReplicaView) else rewards


check_overrides(ParallelRLOOTrainer, RLOOTrainer)
