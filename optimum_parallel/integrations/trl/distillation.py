"""TRL's `DistillationTrainer` with `ParallelTrainerMixin`: on-policy distillation of a teacher into a student on a
tp / sp / cp / pp / dp (sharding levels 0-3) mesh, equal to TRL's `DistillationTrainer` on one process.

TRL's trainer is used as it is; the teacher is parallel on the student's mesh and the divergence is summed over the
vocabulary slices (`vocab_parallel_divergence`). What changes under each layout, and what is refused
(`check_distillation_options`): docs/module_notes.md.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel, set_seed
from trl import DistillationConfig, DistillationTrainer

from ...comm.autograd_collectives import reduce_from_tensor_parallel_region
from ...comm.collectives import all_reduce
from ...context_parallel import mark_gradients_reduced
from ...plan import logits_mode
from ...plan.wrappers import plan_root
from ...state import parallel_state
from ...tensor_parallel.layers import ColumnParallelLinear
from ...tensor_parallel.logprobs import vocab_slice
from ..transformers.internals import check_overrides, private_override
from ..transformers.trainer import ParallelTrainerMixin
from ..transformers.training_args import ParallelTrainingArguments
from .dpo import parallel_reference
from .fused_head import whole_sequence
from .grpo import parallel_generation
from .pipeline_pass import check_whole_rows, surrogate_loss
from .replicas import ReplicaProcesses, seed_replicas


@dataclass
class ParallelDistillationConfig(DistillationConfig, ParallelTrainingArguments):
    """TRL's `DistillationConfig` plus the mesh and parallelism settings of `ParallelTrainingArguments`;
    `DistillationConfig` first, so TRL's defaults win over `TrainingArguments`' own."""


def check_distillation_options(args: DistillationConfig, kwargs: dict[str, Any]) -> None:
    """ValueError naming the first option ParallelDistillationTrainer cannot run."""
    check_whole_rows(args, "ParallelDistillationTrainer", "the pipelines score and generate on whole rows")
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


class ParallelDistillationTrainer(ReplicaProcesses, ParallelTrainerMixin, DistillationTrainer):
    """TRL's `DistillationTrainer` on a parallel student and teacher (docs/module_notes.md); `args` is a
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
        # the same loading and split as DPO's reference
        teacher = parallel_reference(teacher_model, args, AutoModelForCausalLM, _teacher_kwargs(args))
        # under cp the teacher runs with gradients on (`_compute_loss`): frozen, it has none to reduce over dp x cp
        mark_gradients_reduced(plan_root(teacher))
        with _loaded_here(args):
            super().__init__(model, args, model_kwargs=model_kwargs, teacher_model=teacher, **kwargs)
        self._forward_redirection = _call_directly
        self._pipeline_pass: tuple | None = None  # under pp: the step's rows and leaves (`training_step`)
        seed_replicas(self.mesh, args.seed)  # the ranks of a replica sample alike (the seed TRL gives its process)

    # ------------------------------------------------------------------ the batch replicas as TRL's processes
    # (`ReplicaProcesses`: TRL's process count and index, gathers, generation, buffering, loss and entropy over the
    # replicas; the ranks of a replica are one of TRL's processes: its sampler's batches, token counts, loss scale)

    def get_train_dataloader(self):
        with self._over_replicas():
            return super().get_train_dataloader()

    @private_override
    def _get_train_sampler(self, dataset=None):
        with self._over_replicas():
            return super()._get_train_sampler(dataset)

    # ------------------------------------------------------------------ generation and the loss

    @private_override
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
        """TRL's generation through the parallel model's `generate`, sampling from the whole vocabulary's logits
        (`parallel_generation`)."""
        with parallel_generation(self):
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
        if self._pipeline is not None:
            divergence, entropy = self._divergence_through_pipelines(input_ids, attention_mask, keep)
        else:
            divergence, entropy = self._divergence(unwrapped_student, input_ids, attention_mask, keep)
        valid = mask != 0
        loss = divergence.masked_fill(~valid, 0).sum()
        count = valid.sum()
        if num_items_in_batch is None:
            loss = loss / count.clamp(min=1)
        else:
            loss = loss / torch.as_tensor(num_items_in_batch, device=loss.device)
        return loss, entropy.masked_fill(~valid, 0).sum(), count

    def _divergence(self, student_model: nn.Module, input_ids, attention_mask, keep: int):
        """Per completion token (batch, keep): the divergence (its gradient to the student) and the student's
        entropy, on every rank of the replica."""
        # under cp a forward taking a gradient keeps this rank's chunks of the rows (without one, its hook gathers
        # the logits over cp): the teacher then runs with gradients on too, frozen (no graph), so that both models
        # hold the same tokens' logits and no rank holds the whole rows' vocabulary
        chunks = self.mesh.size("cp") > 1 and torch.is_grad_enabled()
        with contextlib.nullcontext() if chunks else torch.no_grad():
            teacher = self._local_logits(self.teacher_model, input_ids, attention_mask)
        student = self._local_logits(student_model, input_ids, attention_mask)
        if not chunks:  # the whole rows: the positions that predict the completion's tokens
            student, teacher = student[:, -keep - 1 : -1], teacher[:, -keep - 1 : -1]
        group = vocab_slice(student_model).group  # divided by the temperature as TRL divides them
        divergence, entropy = vocab_parallel_divergence(
            student / self.temperature, teacher / self.temperature, self.beta, group
        )
        if chunks:  # the whole shifted rows from the cp ranks' tokens (backward: this rank's part, times cp)
            root = plan_root(student_model)
            divergence, entropy = (whole_sequence(x, root)[:, -keep:] for x in (divergence, entropy))
        return divergence, entropy

    @staticmethod
    def _local_logits(model: nn.Module, input_ids, attention_mask) -> torch.Tensor:
        """The logits of this rank's vocabulary slice (under cp in a forward with gradients on: of this rank's
        chunks of the rows)."""
        with _vocab_logits(model, "local"):
            return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    # ------------------------------------------------------------------ pipeline parallelism

    def _divergence_through_pipelines(self, input_ids, attention_mask, keep: int):
        """Under pp: both models' rows through their pipelines without a graph (`run_eval`, this rank's vocabulary
        slice on the last stage), the per-token divergence and entropy computed there and sent to every stage. In
        training the student's logits are a leaf there and the divergence sent is a leaf on every stage: TRL's loss
        backpropagates to it, and `training_step` takes it on to the student's weights."""
        teacher_pipeline = parallel_state(plan_root(self.teacher_model)).pipeline
        student_model = self.accelerator.unwrap_model(self.model)
        pipeline = self._pipeline
        with _vocab_logits(self.teacher_model, "local"), _vocab_logits(student_model, "local"):
            teacher = teacher_pipeline.run_eval(input_ids=input_ids, attention_mask=attention_mask).logits
            student = pipeline.run_eval(input_ids=input_ids, attention_mask=attention_mask).logits
        fields = torch.zeros(2, input_ids.size(0), keep, device=input_ids.device)
        own = None
        if pipeline.holds_last:
            student = student[:, -keep - 1 : -1].detach().requires_grad_(torch.is_grad_enabled())
            teacher = teacher[:, -keep - 1 : -1]
            group = vocab_slice(student_model).group
            divergence, entropy = vocab_parallel_divergence(
                student / self.temperature, teacher / self.temperature, self.beta, group
            )
            fields = torch.stack([divergence.detach().float(), entropy.float()])
            own = divergence, student
        dist.broadcast(fields, src=pipeline.last_rank, group=pipeline.pp_group)
        divergence = fields[0].clone().requires_grad_(torch.is_grad_enabled())
        if torch.is_grad_enabled():
            self._pipeline_pass = input_ids, attention_mask, own, divergence
        return divergence, fields[1]

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """Under pp, two passes (as DPO's and GRPO's): TRL's step, whose divergence the pipelines computed without a
        graph (`_divergence_through_pipelines`), backpropagates TRL's loss to the per-token divergence; on the last
        stage that gradient is taken back to the student's logits, and the pipeline's forward and backward of
        sum(logit weight x logit) give the weights the gradient of TRL's loss (one student forward more than TRL's)."""
        if self._pipeline is None:
            return super().training_step(model, inputs, num_items_in_batch)
        self._pipeline_pass = None
        loss = DistillationTrainer.training_step(self, model, inputs, num_items_in_batch)  # TRL's, to the leaf
        input_ids, attention_mask, own, leaf = self._pipeline_pass
        self._pipeline_pass = None
        weights = None
        if own is not None:  # the last stage: d loss / d (the student's local logits of the completion positions)
            divergence, logits = own
            (weights,) = torch.autograd.grad(divergence, logits, grad_outputs=leaf.grad.to(divergence.dtype))
        root = plan_root(self.accelerator.unwrap_model(model))
        rows = torch.arange(input_ids.size(0), device=input_ids.device)[:, None].expand_as(input_ids)
        with surrogate_loss(root, _LogitWeights(weights)), self.accelerator.autocast():
            model.run_train(input_ids=input_ids, labels=rows, attention_mask=attention_mask)
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """TRL's (the divergence on generated completions); under pp its forwards run through the pipelines."""
        if self._pipeline is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        return DistillationTrainer.prediction_step(self, model, inputs, prediction_loss_only, ignore_keys)


class _LogitWeights:
    """The loss the student's pipeline backpropagates under pp: sum(weight x logit) over the completion positions
    of this rank's vocabulary slice, each micro-batch's share on the last stage; the labels it is given are each
    token's row in the batch, so every share finds its rows' weights."""

    def __init__(self, weights: torch.Tensor | None) -> None:
        self.weights = weights  # (batch, completion, local vocabulary); None off the last stage

    def __call__(self, logits, labels, **kwargs) -> torch.Tensor:
        weights = self.weights[labels[:, 0]].to(logits.dtype)
        return (weights * logits[:, -weights.size(1) - 1 : -1]).sum()


def _vocab_logits(model: nn.Module, mode: str) -> contextlib.AbstractContextManager:
    """`logits_mode(model, mode)` for the block where the model's LM head is split over the vocabulary (tp); else
    its logits are whole already."""
    split = any(isinstance(m, ColumnParallelLinear) and hasattr(m, "logits_mode") for m in model.modules())
    return logits_mode(model, mode) if split else contextlib.nullcontext()


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
    """TRL's `_forward_redirection` without a wrapper to route through (docs/module_notes.md)."""
    del wrapper, original
    return method(*args, **kwargs)


check_overrides(ParallelDistillationTrainer, DistillationTrainer)
check_overrides(ReplicaProcesses, DistillationTrainer)
