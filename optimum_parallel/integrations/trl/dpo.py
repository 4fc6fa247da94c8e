"""TRL's `DPOTrainer` with `ParallelTrainerMixin`: preference optimisation on a tp / sp / cp / dp (sharding levels
0-3) mesh, equal to TRL's `DPOTrainer` on one process.

TRL's trainer is used as it is (dataset preparation, the collator that puts chosen and rejected rows in one batch,
every loss type, the metrics); what changes is where the per-token log-probabilities come from:

- the policy and the reference are both parallel on the same mesh. The reference (no `ref_model`: the policy's
  checkpoint, as TRL loads it) is loaded with `lazy_load_for_parallelism`, each rank reading its slice, frozen, and
  run without a graph; `precompute_ref_log_probs=True` computes its log-probabilities once before training (with
  the policy, as TRL does, and no reference kept); a PEFT policy's reference is its base with the adapters disabled;
- TRL's fused LM head, which multiplies the hidden states by `lm_head.weight` (a vocabulary slice under tp) and
  scores whole rows (a rank holds chunks of them under cp), is replaced by the parallel one (`fused_head.py`): the
  vocab-parallel log-softmax, the per-token numbers gathered over cp, so that TRL's sums over each completion, its
  losses and its metrics are those of one process.

Refused before anything changes, by name (`check_dpo_options`): `pipeline_parallel_size > 1` (the DPO loss couples
the chosen and rejected rows of a pair and the reference's log-probabilities, which the pipeline's per-micro-batch
token loss cannot carry), `use_liger_kernel`, `sync_ref_model` (the policy's FSDP2 shards and the replicated
reference do not line up), and a MoE model's `router_aux_loss_coef != 0`. A dataset without `chosen` / `rejected`
raises TRL's error on every rank before any collective.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, set_seed
from trl import DPOConfig, DPOTrainer

from ...engine.compose import compose_model
from ...engine.validate import validate
from ...frontends.manager import ParallelizersManager
from ...plan.wrappers import plan_root
from ..transformers.internals import check_overrides, private_override
from ..transformers.lazy_loading import lazy_load_for_parallelism
from ..transformers.trainer import ParallelTrainerMixin, _mesh_for
from ..transformers.training_args import ParallelTrainingArguments, trainer_request
from .fused_head import install_fused_head


@dataclass
class ParallelDPOConfig(ParallelTrainingArguments, DPOConfig):
    """TRL's `DPOConfig` plus the mesh and parallelism settings of `ParallelTrainingArguments`."""


def check_dpo_options(args: DPOConfig) -> None:
    """ValueError naming the first TRL option that cannot work on the layout `args` asks for."""
    if args.pipeline_parallel_size > 1:
        raise ValueError(
            f"pipeline_parallel_size={args.pipeline_parallel_size} is not supported by ParallelDPOTrainer: the DPO "
            "loss of a pair needs its chosen and rejected rows and the reference's log-probabilities together, and "
            "the pipeline's loss is a per-micro-batch token loss; allowed: 1 (use tensor_parallel_size, "
            "context_parallel_size and sharding_level to split the model)"
        )
    if args.use_liger_kernel:
        raise ValueError(
            "use_liger_kernel=True is not supported by ParallelDPOTrainer (Liger's kernels replace the modules the "
            "parallel layout is built on); allowed: False"
        )
    if args.sync_ref_model:
        raise ValueError(
            "sync_ref_model=True is not supported by ParallelDPOTrainer (the policy's data-parallel shards and the "
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
    """TRL's `DPOTrainer` on a parallel model (see the module docstring); `args` is a `ParallelDPOConfig`, `model` a
    transformers model or a checkpoint path, `ref_model` None (the policy's checkpoint), a model or a path."""

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
        check_dpo_options(args)
        if kwargs.get("train_dataset") is None:
            raise ValueError("`train_dataset` is required")
        check_preference_dataset(kwargs["train_dataset"])
        if ref_model is not None and ref_model is model:
            raise ValueError("`model` and `ref_model` cannot be the same object; omit `ref_model` for a copy")
        base_as_reference = ref_model is None and kwargs.get("peft_config") is not None
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
            ref_model = self._parallel_reference(ref_model, args, model_class, kwargs_for_ref)
        if base_as_reference:
            config = model.config if isinstance(model, PreTrainedModel) else AutoConfig.from_pretrained(model)
            ref_model = _BaseAsReference(config)
        set_seed(args.seed)  # as TRL, before the policy is built: a PEFT adapter's init draws the same numbers
        super().__init__(model, args, model_class=model_class, model_kwargs=model_kwargs, ref_model=ref_model, **kwargs)
        if isinstance(self.ref_model, _BaseAsReference):
            self.ref_model = None
        if self.aux_loss_enabled:
            raise ValueError(
                f"router_aux_loss_coef={self.router_aux_loss_coef} is not supported by ParallelDPOTrainer (the "
                "parallel fused head computes no router aux loss); allowed: router_aux_loss_coef=0.0"
            )
        self._install_fused_heads()
        self._tp_size = self.get_tp_size()  # TRL divides its token count over the world by this

    def _parallel_reference(
        self, ref: PreTrainedModel | str | os.PathLike, args: ParallelDPOConfig, model_class: type, kwargs: dict
    ) -> PreTrainedModel:
        """The reference on the policy's mesh (tp / sp / cp; replicated over dp), frozen; from a path, each rank
        reads its slice only."""
        request = trainer_request(args, device=args.device)
        mesh = _mesh_for(request, args.ddp_timeout)
        if isinstance(ref, (str, os.PathLike)):
            sizes = args.tensor_parallel_size, args.pipeline_parallel_size, args.expert_parallel_size
            with lazy_load_for_parallelism(*sizes):
                ref = model_class.from_pretrained(ref, **kwargs)
        inner = plan_root(ref)
        family = ParallelizersManager.parallelizer_for_model(ref)
        checked = validate(replace(request, family=family, optimizer=None), inner, mesh)
        compose_model(inner, mesh, checked)
        ref.requires_grad_(False)
        return ref.eval()

    def _install_fused_heads(self) -> None:
        """The parallel fused head on the policy (its base under PEFT) and the reference, where TRL put its own."""
        policy = self.model.get_base_model() if _is_peft(self.model) else self.model
        install_fused_head(plan_root(policy))
        if self.ref_model is not None and not isinstance(self.ref_model, _BaseAsReference):
            install_fused_head(plan_root(self.ref_model))

    @private_override
    def _precompute_ref_logps(self, dataset, name: str, batch_size: int):
        """The reference's log-probabilities of every row, added as columns (TRL's columns). Every rank runs every
        batch in order (the tp / cp ranks of a batch run its collectives together), so no rank waits on another's
        data; TRL's cache file is not written."""
        from datasets import IterableDataset

        if isinstance(dataset, IterableDataset):
            raise ValueError(
                "`precompute_ref_log_probs=True` is not supported with IterableDataset. Please use a map-style "
                "Dataset or set `precompute_ref_log_probs=False`."
            )
        self._install_fused_heads()
        if isinstance(self.ref_model, _BaseAsReference):
            self.ref_model = None  # the base, adapters disabled (TRL's `compute_ref_log_probs` reads this)
        loader = DataLoader(dataset, batch_size=batch_size, collate_fn=self.data_collator, shuffle=False)
        model = self.ref_model or self.model
        chosen, rejected = [], []
        for batch in loader:
            batch = {k: v.to(self.args.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            ref_chosen, ref_rejected = self.compute_ref_log_probs(model, batch)
            chosen.append(ref_chosen.float().cpu())
            rejected.append(ref_rejected.float().cpu())
        dataset = dataset.add_column("ref_chosen_logps", torch.cat(chosen).tolist())
        return dataset.add_column("ref_rejected_logps", torch.cat(rejected).tolist())


check_overrides(ParallelDPOTrainer, DPOTrainer)
