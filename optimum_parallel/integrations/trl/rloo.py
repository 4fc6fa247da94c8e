"""TRL's `RLOOTrainer` with `ParallelTrainerMixin` (`ParallelRLOOTrainer`, `ParallelRLOOConfig`): completions
generated, scored and trained on by the parallel model on a tp / sp / cp / pp / dp mesh (sharding levels 0-3), equal
to TRL's `RLOOTrainer` on one process. It reuses GRPO's parallel pieces (`grpo.py`), TRL's gathers run over the batch
replicas, and `check_rloo_options` refuses by name what a layout cannot run. Design notes: docs/module_notes.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from transformers import set_seed
from trl import RLOOConfig, RLOOTrainer
from trl.trainer import rloo_trainer as trl_rloo

from ...plan.wrappers import plan_root
from ...tensor_parallel.logprobs import IGNORE_INDEX
from ..transformers.internals import check_overrides, private_override
from ..transformers.trainer import ParallelTrainerMixin
from ..transformers.training_args import ParallelTrainingArguments
from .fused_head import FusedHead, install_fused_head
from .grpo import (
    ParallelGRPOConfig,
    ParallelGRPOTrainer,
    _size_generation_batch,
    check_sampling_options,
    parallel_generation,
    two_pass_step,
)
from .replicas import (
    ReplicaProcesses,
    ReplicaView,
    check_module_globals,
    mean_over_replicas,
    seed_replicas,
    swapped_globals,
)

check_module_globals(trl_rloo, "ParallelRLOOTrainer")


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
    check_sampling_options("ParallelRLOOTrainer", args, kwargs)  # GRPO's, less those of options RLOO lacks


class ParallelRLOOTrainer(ReplicaProcesses, ParallelTrainerMixin, RLOOTrainer):
    """TRL's `RLOOTrainer` on a parallel model (docs/module_notes.md); `args` is a `ParallelRLOOConfig`.

    `ParallelRLOOTrainer(model_or_path, reward_funcs=..., args=ParallelRLOOConfig(...), train_dataset=...,
    processing_class=tokenizer)`; launch with torchrun.
    """

    # under pp the dataset keeps TRL's columns (TRL generates from the prompts), not the pipeline's input columns
    pipeline_columns = ("prompt", "image", "images")
    trl_module = trl_rloo  # TRL's gathers and reductions run over the batch replicas (`ReplicaProcesses`)

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
        # the ranks of a replica sample, shuffle and draw alike (one process: the seed TRL gives process 0)
        seed_replicas(self.mesh, args.seed)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's clipped per-sequence loss and its metrics, with the replicas as its processes. Under pp, in training,
        the rows TRL scores (prompt and completion, the completion's tokens labelled) are kept for `training_step`."""
        if self._pipeline is not None and torch.is_grad_enabled():
            input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
            labels[:, : inputs["prompt_ids"].size(1)] = IGNORE_INDEX
            self._pipeline_pass = input_ids, attention_mask, labels
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)  # over the replicas

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """Under pp, DPO's two passes (as `ParallelGRPOTrainer.training_step`): TRL's step, whose log-probs the
        pipeline scored without a graph (a leaf, `FusedHead.pipeline_log_probs`), backpropagates TRL's loss to them;
        then the pipeline's forward and backward of sum(weight x log p(token)), the weights being that gradient and
        the logits divided by the temperature, give the parameters the gradient of TRL's loss."""
        if self._pipeline is None:
            return super().training_step(model, inputs, num_items_in_batch)
        return two_pass_step(self, RLOOTrainer.training_step, model, inputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """TRL's evaluation loss, the mean of the replicas' (each the mean over its sequences), on every replica;
        under pp TRL's own, its scoring through the pipeline (the Trainer's pp evaluation scores labels of its own)."""
        if self._pipeline is None:
            loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        else:
            loss, logits, labels = RLOOTrainer.prediction_step(self, model, inputs, prediction_loss_only, ignore_keys)
        return mean_over_replicas(loss, self.mesh), logits, labels

    @private_override
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
        """TRL's generation through the parallel model's tp-synchronised `generate`, sampling from full-vocabulary
        logits even inside an evaluation that keeps them local; under cp and pp without a kv cache (under pp through
        the pipeline's stages; `parallel_generation`)."""
        with parallel_generation(self):
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
check_overrides(ReplicaProcesses, RLOOTrainer)
