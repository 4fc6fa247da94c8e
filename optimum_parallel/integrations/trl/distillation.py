"""TRL's `DistillationTrainer` with `ParallelTrainerMixin`: on-policy distillation of a teacher into a student on a
tp / sp / dp (sharding levels 0-3) mesh, equal to TRL's `DistillationTrainer` on one process.

TRL's trainer is used as it is (prompt preparation, the student's generation -- through the parallel model's
tp-synchronised `generate` --, buffering, metrics); what changes:

- the teacher is parallel on the student's mesh, as DPO's reference is (`ParallelDPOTrainer._parallel_reference`):
  read lazily, each rank its slice, frozen, no optimizer state;
- TRL's chunked divergence multiplies hidden states by each model's whole `lm_head.weight`, which under tp is a
  slice of the vocabulary: here both models run their own forward (logits of this rank's vocabulary slice, the
  sequence gathered under sp, the models' own logit scale and soft-capping applied), and the generalized JSD, the
  KLs and the student's entropy are summed over the vocabulary slices with all-reduces (`vocab_parallel_divergence`:
  TRL's formula, its gradient to the student only);
- TRL routes that loss through the DDP/FSDP wrapper (`_forward_redirection`); the parallel model owns its gradient
  reduction, so it is called directly; TRL's gathers, process count and index are the batch replicas'
  (`replicas.ReplicaView`), so its sampler, token counts and loss scale are those of TRL on dp processes.

Refused before anything changes, by name (`check_distillation_options`): cp and pp (TRL itself refuses sequence
splitting here; the pipeline has no generate), `use_vllm`, tools (`tools` / a replica of several ranks would run them
on each rank), and `quantization_config`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.nn.functional as dist_nn
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel, set_seed
from trl import DistillationConfig, DistillationTrainer

from ...comm.autograd_collectives import reduce_from_tensor_parallel_region
from ...comm.collectives import all_reduce
from ...plan import logits_mode
from ...tensor_parallel.logprobs import vocab_slice
from ...tensor_parallel.random import share_rng_states
from ..transformers.internals import check_overrides, private_override
from ..transformers.trainer import ParallelTrainerMixin
from ..transformers.training_args import ParallelTrainingArguments
from .dpo import ParallelDPOTrainer
from .replicas import over_replicas


@dataclass
class ParallelDistillationConfig(DistillationConfig, ParallelTrainingArguments):
    """TRL's `DistillationConfig` plus the mesh and parallelism settings of `ParallelTrainingArguments`;
    `DistillationConfig` first, so TRL's defaults win over `TrainingArguments`' own."""


def check_distillation_options(args: DistillationConfig, kwargs: dict[str, Any]) -> None:
    """ValueError naming the first option ParallelDistillationTrainer cannot run."""
    for option, why in (
        ("context_parallel_size", "TRL's DistillationTrainer splits no sequence, and the completions are generated "
         "whole"),
        ("pipeline_parallel_size", "the student generates its completions, which the pipeline's stages do not run"),
    ):  # fmt: skip
        if getattr(args, option) > 1:
            raise ValueError(
                f"{option}={getattr(args, option)} is not supported by ParallelDistillationTrainer ({why}); allowed: 1"
            )
    if args.use_vllm:
        raise ValueError("use_vllm=True is not supported by ParallelDistillationTrainer; allowed: False")
    for name in ("tools", "quantization_config"):
        if kwargs.get(name):
            raise ValueError(f"{name} is not supported by ParallelDistillationTrainer; allowed: None")


def vocab_parallel_divergence(
    student: torch.Tensor, teacher: torch.Tensor, beta: float, group
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: TRL's divergence of the student's from the teacher's next-token distribution (beta 0: KL(teacher ||
    student), 1: KL(student || teacher), else the generalized JSD with mixture (1 - beta) p_s + beta p_t) and the
    student's entropy, from logits holding this rank's vocabulary slice (`group`: the slices' ranks; None: whole).
    fp32; the gradient reaches the student's logits only."""

    def total(x: torch.Tensor) -> torch.Tensor:  # the per-token result: every rank backpropagates its own terms
        return x if group is None else reduce_from_tensor_parallel_region(x, group)

    def log_softmax(z: torch.Tensor) -> torch.Tensor:
        top = z.detach().amax(-1, keepdim=True)
        if group is not None:
            top = all_reduce(top, group, op=torch.distributed.ReduceOp.MAX)
        norm = (z - top).exp().sum(-1, keepdim=True)
        if group is not None:  # every rank's terms read the normaliser: its gradient is summed over the slices
            norm = dist_nn.all_reduce(norm, group=group)
        return z - top - norm.log()

    log_ps, log_pt = log_softmax(student.float()), log_softmax(teacher.detach().float())
    ps, pt = log_ps.exp(), log_pt.exp()
    entropy = total(-(ps * log_ps).sum(-1)).detach()
    if beta == 0.0:
        return total((pt * (log_pt - log_ps)).sum(-1)), entropy
    if beta == 1.0:
        return total((ps * (log_ps - log_pt)).sum(-1)), entropy
    log_m = torch.logaddexp(log_ps + torch.log(torch.tensor(1 - beta)), log_pt + torch.log(torch.tensor(beta)))
    terms = beta * pt * (log_pt - log_m) + (1 - beta) * ps * (log_ps - log_m)
    return total(terms.sum(-1)), entropy


def _teacher_kwargs(args: DistillationConfig) -> dict[str, Any]:
    """TRL's `from_pretrained` arguments for a teacher given as a path (`teacher_model_init_kwargs`, the dtype named as
    a string made a torch dtype, the revision), without a device map (each rank places its slice)."""
    kwargs = dict(args.teacher_model_init_kwargs or {})
    dtype = kwargs.get("dtype")
    kwargs["dtype"] = dtype if dtype in ("auto", None) or isinstance(dtype, torch.dtype) else getattr(torch, dtype)
    if args.teacher_model_revision is not None:
        kwargs.setdefault("revision", args.teacher_model_revision)
    kwargs.pop("device_map", None)
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    return kwargs


class ParallelDistillationTrainer(ParallelTrainerMixin, DistillationTrainer):
    """TRL's `DistillationTrainer` on a parallel student and teacher (see the module docstring); `args` is a
    `ParallelDistillationConfig`, `model` and `teacher_model` transformers models or checkpoint paths."""

    def __init__(
        self,
        model: PreTrainedModel | str | os.PathLike,
        teacher_model: PreTrainedModel | str | os.PathLike | None = None,
        args: ParallelDistillationConfig | None = None,
        *,
        model_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(args, ParallelDistillationConfig):
            raise TypeError(
                f"ParallelDistillationTrainer needs ParallelDistillationConfig arguments, got {type(args).__name__}"
            )
        check_distillation_options(args, kwargs)
        teacher_model = teacher_model if teacher_model is not None else args.teacher_model_name_or_path
        if teacher_model is None:
            raise ValueError("teacher_model: a model or a checkpoint path (or args.teacher_model_name_or_path)")
        if model_kwargs is None and isinstance(model, (str, os.PathLike)):
            model_kwargs = dict(args.model_init_kwargs or {})  # TRL's for a student given as a path
            model_kwargs.pop("device_map", None)
        set_seed(args.seed)  # as TRL, before the student is built
        # the same loading and split as DPO's reference (the helper does not read `self`)
        teacher = ParallelDPOTrainer._parallel_reference(
            self, teacher_model, args, AutoModelForCausalLM, _teacher_kwargs(args)
        )
        with _loaded_here(args):
            super().__init__(model, args, model_kwargs=model_kwargs, teacher_model=teacher, **kwargs)
        self._forward_redirection = _call_directly
        # TRL seeded each process apart; the ranks of a replica sample alike (the seed TRL gives its process)
        set_seed(args.seed + self.mesh.rank("batch"))
        share_rng_states(self.mesh.group("peers"))

    # ------------------------------------------------------------------ the batch replicas as TRL's processes

    def _over_replicas(self):
        """TRL's gathers, process count and index over the batch replicas for the block (`replicas.ReplicaView`): the
        ranks of a replica are one of TRL's processes (its sampler's batches, token counts and loss scale)."""
        return over_replicas(self)

    def get_train_dataloader(self):
        with self._over_replicas():
            return super().get_train_dataloader()

    @private_override
    def _get_train_sampler(self, dataset=None):
        with self._over_replicas():
            return super()._get_train_sampler(dataset)

    @private_override
    def _prepare_inputs(self, generation_batch):
        """TRL's generation and buffering, with the replicas as its processes."""
        with self._over_replicas():
            return super()._prepare_inputs(generation_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss and entropy, with the replicas as its processes."""
        with self._over_replicas():
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    # ------------------------------------------------------------------ generation and the loss

    @private_override
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
        """TRL's generation through the parallel model's `generate`, sampling from the whole vocabulary's logits."""
        with logits_mode(self.model, "full"):
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, has_tool_images)

    @private_override
    def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
        """TRL's loss (the divergence summed over the completion tokens, over `num_items_in_batch` or the local
        count), its entropy sum and token count, from the two models' vocab-parallel logits."""
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        keep = inputs["completion_ids"].size(1)
        self.teacher_model.eval()
        with torch.no_grad():
            teacher = self._completion_logits(self.teacher_model, input_ids, attention_mask, keep)
        student = self._completion_logits(unwrapped_student, input_ids, attention_mask, keep)
        divergence, entropy = vocab_parallel_divergence(student, teacher, self.beta, vocab_slice(self.model).group)
        valid = mask != 0
        loss = divergence.masked_fill(~valid, 0).sum()
        count = valid.sum()
        if num_items_in_batch is None:
            loss = loss / count.clamp(min=1)
        else:
            loss = loss / torch.as_tensor(num_items_in_batch, device=loss.device)
        return loss, entropy.masked_fill(~valid, 0).sum(), count

    def _completion_logits(self, model: nn.Module, input_ids, attention_mask, keep: int) -> torch.Tensor:
        """The logits (this rank's vocabulary slice) that predict the last `keep` tokens, divided by the
        temperature as TRL divides them."""
        with logits_mode(model, "local"):
            logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        return logits[:, -keep - 1 : -1] / self.temperature


@contextlib.contextmanager
def _loaded_here(args: DistillationConfig) -> Iterator[None]:
    """Both models were loaded here with their `*_model_init_kwargs`: TRL, given them loaded, refuses a teacher's
    kwargs and warns about the student's, so it sees neither (they are back when it returns)."""
    saved = args.model_init_kwargs, args.teacher_model_init_kwargs
    args.model_init_kwargs = args.teacher_model_init_kwargs = None
    try:
        yield
    finally:
        args.model_init_kwargs, args.teacher_model_init_kwargs = saved


def _call_directly(wrapper: nn.Module, original: nn.Module, method, *args: Any, **kwargs: Any):
    """TRL's `_forward_redirection` without a wrapper to route through (see the module docstring)."""
    del wrapper, original
    return method(*args, **kwargs)


check_overrides(ParallelDistillationTrainer, DistillationTrainer)
