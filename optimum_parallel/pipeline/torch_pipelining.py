"""Pipeline-parallel training on torch.distributed.pipelining: stages, schedules, run_train / run_eval.

The pipeline is a stage runner: the engine hands it the stage modules, how a whole batch becomes this rank's
(`PipelineBatches`: context parallelism cuts it there), the sequence-parallel region its stages enter and leave, and,
with data parallelism, the group whose replicas' tokens the loss counts and the gradient averaging to run after the
batch. It imports no other parallelism.

No `torch_xla.sync()` here: on XLA devices the mesh refuses pp > 1 (`mesh/xla_mesh.py`: torch-xla runs every send and
receive as a collective_permute plus a sync of its own, so the step cannot be one graph). `run_train` is forward and
backward only; the one sync per optimizer step belongs after the step, where the Trainer (or a custom loop) puts it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..comm.tp_entry import SequenceRegion
from ..mesh import ParallelMesh, ranks
from ..mesh import device as devices
from ..mesh.loaded import local_tensor
from ..state import parallel_state, refuse
from .batches import PipelineBatches
from .carrier import LanguageInputs, StepCarrier, deepstack_layers
from .images import IMAGE_KEYS, deal_images
from .per_layer import PerLayerInputs
from .schedules import (
    SCHEDULES,
    check_pipeline,
    decoder_parts,
    schedule_class,
    stage_indices,
    stage_owner,
)
from .split import SplitPoint
from .stage import DecoderStage, prune_to_stages
from .torch_versions import TorchStage, torch_schedule

IGNORE_INDEX = -100
MAX_SCHEDULES = 8
# the entry's parameters that are not model inputs a batch gives beside the token ids
NOT_MODEL_INPUTS = {
    "self", "input_ids", "inputs_embeds", "attention_mask", "position_ids", "labels", "cache", "past_key_values",
    "use_cache", "cache_position", "mm_encoder_outputs", "logits_to_keep", "return_dict", "output_attentions",
    "output_hidden_states", "kwargs", "args",
}  # fmt: skip


@dataclass
class PipelineOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor | None  # the last stage's (None elsewhere)


class Pipeline:
    """The rank's stages and the schedule that drives them; `run_train` / `run_eval` take a whole batch."""

    def __init__(
        self,
        model: nn.Module,
        stages: list[DecoderStage],
        mesh: ParallelMesh,
        schedule: str,
        num_microbatches: int,
        tied: bool,
        batches: PipelineBatches,
        model_keys: tuple[str, ...] = (),
        classifier: str | None = None,
    ) -> None:
        self.model, self.stages, self.mesh, self.batches = model, stages, mesh, batches
        self.classifier = classifier  # a sequence classifier's head: its last stage returns every position's scores
        self.model_keys = model_keys  # the model's inputs beyond the token ids a batch may give (images, token types)
        self._vocab_size = model.config.get_text_config().vocab_size  # a vision-language model's: its text config's
        self.num_microbatches = num_microbatches
        self.pp_group = mesh.group("pp")
        per_rank, self.placement = SCHEDULES[schedule]
        schedule_cls = torch_schedule(schedule_class(schedule))
        num_stages = self.num_stages = mesh.size("pp") * per_rank
        self.stages_by_index = {stage.stage_index: stage for stage in stages}
        self.device = devices.current_device(mesh.device_type)
        self._single = per_rank == 1
        self._schedule_cls = schedule_cls
        # torch 2.13's step() takes return_outputs (False: the last stage's outputs are not merged); torch 2.9's has no
        # such parameter and would hand it to the stage's forward
        takes_flag = "return_outputs" in inspect.signature(schedule_cls.step).parameters
        self._step_options = {"return_outputs": False} if takes_flag else {}
        # torch's stages fix their buffers' shapes at their first step: one schedule per micro-batch shape (batches of
        # other lengths, packed rows), the most recent few kept
        self._schedules: dict[tuple, object] = {}
        self.holds_first = any(s.is_first for s in stages)
        self.holds_last = any(s.is_last for s in stages)
        # the module holding this rank's side of a tied embedding / LM head, read anew each time: FSDP2 replaces it
        ends = [s.embed_tokens if s.is_first else s.lm_head for s in stages if s.is_first or s.is_last]
        self._tied_holder = ends[0] if tied and ends else None
        # set by data parallelism: the averaging of the gradients after the batch (sharding levels 0-1), and the dp
        # group: the batch replicas whose tokens the loss counts
        self.reduce_gradients: Callable[[list[nn.Module]], None] | None = None
        self.replicas_group: dist.ProcessGroup | None = None
        self._num_items: torch.Tensor | None = None  # the divisor of the step running now (see `_loss`)
        first, last = self.owner(0), self.owner(num_stages - 1)
        self.last_rank = mesh.ranks("pp")[last]
        # tied embedding / LM head on two ranks: their gradients are summed (one rank holding both needs nothing)
        self.tied_group = mesh.group_of("pp", (first, last)) if tied and first != last else None

    def _schedule_for(self, key: tuple | None):
        """The schedule (over its own torch stages) for inputs of shapes `key`; built on first use."""
        schedule = self._schedules.pop(key, None)
        if schedule is None:
            torch_stages = [
                TorchStage(stage, stage.stage_index, self.num_stages, self.device, group=self.pp_group)
                for stage in self.stages
            ]
            # each micro-batch's loss is its token-loss sum over the whole batch's token count (`_loss`): the schedule
            # must add the micro-batch gradients, not average them (its default averages, which weights micro-batches
            # equally whatever their number of labelled tokens)
            schedule = self._schedule_cls(
                torch_stages[0] if self._single else torch_stages,
                self.num_microbatches,
                loss_fn=self._loss,
                scale_grads=False,
            )
        self._schedules[key] = schedule  # most recent last
        while len(self._schedules) > MAX_SCHEDULES:
            self._schedules.pop(next(iter(self._schedules)))
        return schedule

    @property
    def tied(self) -> nn.Parameter | None:
        """This rank's parameter of a tied embedding / LM head (None when the weights are not tied)."""
        return None if self._tied_holder is None else self._tied_holder.weight

    def owner(self, index: int) -> int:
        return stage_owner(index, self.mesh.size("pp"), self.placement)

    def _check_loss(self) -> None:
        """A sequence classifier trains only with a loss over the last stage's per-position scores (the reward
        trainer's): transformers' own pools the scores of one device's whole rows. Raised on every rank."""
        loss = getattr(self.model, "loss_function", None)
        if self.classifier is not None and getattr(loss, "__name__", "") == "ForSequenceClassificationLoss":
            raise ValueError(
                f"{type(self.model).__name__} (head {self.classifier!r}) cannot train under pipeline parallelism with "
                "transformers' sequence-classification loss: the last stage returns every position's scores, which "
                "that loss does not take. ParallelRewardTrainer trains it under pp; allowed otherwise: "
                "pipeline_parallel_size=1"
            )

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One micro-batch's share of the batch loss: its token losses summed, over the batch's token count (the
        schedule calls this with (output, target) only, so the count of the running step is read from `self`)."""
        return self.model.loss_function(
            logits=logits, labels=labels, vocab_size=self._vocab_size, num_items_in_batch=self._num_items
        )

    @property
    def data_parallel_size(self) -> int:
        """The batch replicas whose gradients data parallelism averages (1 without data parallelism)."""
        return 1 if self.replicas_group is None else ranks.world_size(self.replicas_group)

    def _divisor(
        self, labels: torch.Tensor, num_items_in_batch: int | torch.Tensor | None, replicas: int
    ) -> torch.Tensor:
        """What each token-loss sum is divided by: the labelled (shifted) tokens of the global batch, over the
        `replicas` whose gradients are averaged, so that the average is the gradient of the global token mean."""
        if num_items_in_batch is None:
            count = (labels[..., 1:] != IGNORE_INDEX).sum().to(self.device)
            if replicas > 1:
                dist.all_reduce(count, group=self.replicas_group)
        else:
            count = torch.as_tensor(num_items_in_batch, device=self.device)
        return count if replicas == 1 else count.float() / replicas  # no host read: the step stays asynchronous

    def _inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, model_inputs: Mapping):
        """The first stage's arguments (the token ids and the carrier: a mask of ones when there is none, the
        row-aligned model inputs, the row numbers when there are images) and the step's carrier, set on every stage."""
        if input_ids.shape[0] % self.num_microbatches:
            raise ValueError(
                f"batch size {input_ids.shape[0]} is not divisible by pipeline_parallel_num_microbatches="
                f"{self.num_microbatches}"
            )
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        rows = {k: v for k, v in model_inputs.items() if k not in IMAGE_KEYS}
        for key, value in rows.items():
            if not torch.is_tensor(value) or tuple(value.shape[:2]) != tuple(input_ids.shape):
                shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
                raise TypeError(
                    "pipeline batches take model inputs laid out along the rows (batch, seq) = "
                    f"{tuple(input_ids.shape)} or images; got {key} of {shape}"
                )
        images = deal_images(self.model.config, input_ids, model_inputs)
        carrier = StepCarrier(tuple(rows), images)
        for stage in self.stages:
            stage.carrier = carrier
        numbers = (torch.arange(input_ids.shape[0]),) if images is not None else ()  # read on the host: no device sync
        return (input_ids, attention_mask, *rows.values(), *numbers), carrier

    def _split_extra(self, extra: Mapping) -> tuple[dict, dict]:
        """(the batch functions' keys, the model's inputs) of a batch's other keys; refuses images in packed rows."""
        self._reject(extra)
        packing = {k: v for k, v in extra.items() if k in self.batches.keys}
        model_inputs = {k: v for k, v in extra.items() if k in self.model_keys and v is not None}
        if model_inputs and any(torch.is_tensor(v) for v in packing.values()):
            raise NotImplementedError(
                f"pipeline batches with {', '.join(sorted(model_inputs))} cannot be packed rows "
                f"({', '.join(k for k, v in packing.items() if torch.is_tensor(v))}); allowed: padded rows"
            )
        return packing, model_inputs

    def _batch_loss(self, losses: list[torch.Tensor], replicas: int) -> torch.Tensor:
        """The global batch loss on every rank: the micro-batch shares added on the last stage, sent to the other
        stages, and added over the `replicas` (each share was divided by count / replicas)."""
        if self.holds_last:
            loss = torch.stack([x.detach().double() for x in losses]).sum() / replicas
        else:
            loss = torch.zeros((), dtype=torch.double, device=self.device)
        dist.broadcast(loss, src=self.last_rank, group=self.pp_group)
        if replicas > 1:
            dist.all_reduce(loss, group=self.replicas_group)
        return loss.float()

    def run_train(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        **extra,
    ) -> torch.Tensor:
        """Forward and backward over all micro-batches (gradients accumulated); returns the loss of the global batch.

        The loss is the mean over every labelled token of the global batch (every micro-batch, every data-parallel
        replica's rows), on every rank; the gradients, once data parallelism has averaged them, are its gradients:
        the single-device step on the whole batch. `num_items_in_batch` is that token count (the Trainer's); without
        it the labelled tokens are counted here (after the causal shift, summed over the replicas). `extra`: the
        batch keys the engine's batch functions take (`PipelineBatches.keys`: a packed batch's position ids and
        document boundaries; and the model's own inputs beyond the token ids: a vision-language model's images and
        their token types, each micro-batch's images run by the first stage)."""
        self._check_loss()
        packing, model_inputs = self._split_extra(extra)
        input_ids, labels, attention_mask, _ = self.batches.prepare(
            input_ids, labels, attention_mask, self.num_microbatches, **packing
        )
        replicas = self.data_parallel_size
        self._num_items = self._divisor(labels, num_items_in_batch, replicas)
        input_ids, labels, attention_mask, _ = self.batches.split(
            input_ids, labels, attention_mask, self.num_microbatches
        )
        losses: list[torch.Tensor] = []
        target = labels if self.holds_last else None
        tied_before = self._tied_gradient()
        inputs, carrier = self._inputs(input_ids, attention_mask, model_inputs)
        key = (*((tuple(t.shape), t.dtype) for t in inputs), carrier.first_names())
        schedule = self._schedule_for(key)
        try:
            schedule.step(*(inputs if self.holds_first else ()), target=target, losses=losses, **self._step_options)
        finally:
            self._num_items = None
            self._end_step()
        self._sync_tied_gradients(tied_before)
        if self.reduce_gradients is not None:
            self.reduce_gradients(self.stages)
        return self._batch_loss(losses, replicas)

    @torch.no_grad()
    def run_eval(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        **extra,
    ) -> PipelineOutput:
        """Forward only, micro-batch by micro-batch through the stages in order (any placement, any schedule);
        the loss (if labels are given: the mean over this batch's labelled tokens) on every rank, the logits on the
        last stage."""
        packing, model_inputs = self._split_extra(extra)
        input_ids, labels, attention_mask, restore = self.batches.prepare(
            input_ids, labels, attention_mask, self.num_microbatches, **packing
        )
        if labels is not None:
            self._num_items = self._divisor(labels, None, 1)
        input_ids, labels, attention_mask, cut = self.batches.split(
            input_ids, labels, attention_mask, self.num_microbatches
        )
        inputs, _ = self._inputs(input_ids, attention_mask, model_inputs)
        chunks = zip(*(t.chunk(self.num_microbatches) for t in inputs), strict=True)
        losses, logits = [], []
        try:
            for index, chunk in enumerate(chunks):
                out = self._forward_through_stages(chunk)
                if out is not None:
                    logits.append(out)
                    if labels is not None:
                        losses.append(self._loss(out, labels.chunk(self.num_microbatches)[index]))
        finally:
            self._num_items = None
            self._end_step()
        loss = self._batch_loss(losses, 1) if labels is not None else None
        logits = torch.cat(logits) if logits else None
        if logits is not None and cut is not None:  # the whole sequence, from the ranks' shares of it
            logits = self.batches.gather_logits(logits, cut)
        if logits is not None and restore is not None:  # back in the caller's rows
            logits = restore(logits)
        return PipelineOutput(loss=loss, logits=self._whole_vocabulary(logits))

    def _whole_vocabulary(self, logits: torch.Tensor | None) -> torch.Tensor | None:
        """A vocab-parallel head computed this tp rank's slice of the vocabulary: the caller reads the whole of it,
        as the model's own forward gives it (`plan/caller_outputs.py`), unless `logits_mode(model, "local")`."""
        head = next((s.lm_head for s in self.stages if s.is_last), None)
        gather = getattr(head, "gather", None)
        if logits is None or gather is None or getattr(head, "logits_mode", "auto") == "local":
            return logits
        if getattr(head, "gather_output", False) or logits.shape[-1] == head.out_features:
            return logits  # already whole
        return gather(logits)

    def _end_step(self) -> None:
        """The step's carrier dropped (its images with it)."""
        for stage in self.stages:
            stage.carrier = StepCarrier()

    def _reject(self, extra: Mapping) -> None:
        known = (*self.batches.keys, *self.model_keys)
        unknown = sorted(k for k, v in extra.items() if k not in known and v is not None)
        if unknown:
            allowed = ", ".join(("input_ids", "labels", "attention_mask", *known))
            raise TypeError(f"pipeline batches take {allowed}; got also {unknown}")

    def _forward_through_stages(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
        """Run every stage this rank holds on one micro-batch's first-stage `inputs`, receiving from / sending to the
        ranks of the neighbouring stages what travels (each tensor after a header of its dtype and shape)."""
        pp_ranks, me = self.mesh.ranks("pp"), self.mesh.rank("pp")
        carried = inputs
        for index in range(self.num_stages):
            stage = self.stages_by_index.get(index)
            if stage is None:
                continue
            if index > 0 and self.owner(index - 1) != me:
                carried = _recv_tensors(pp_ranks[self.owner(index - 1)], self.pp_group, self.device)
            out = stage(*carried)
            if index == self.num_stages - 1:
                return out
            carried = out
            if self.owner(index + 1) != me:
                _send_tensors(out, pp_ranks[self.owner(index + 1)], self.pp_group, self.device)
        return None

    def _tied_gradient(self) -> torch.Tensor | None:
        """This rank's part of the tied weight's gradient before a step (already summed over both stages), when
        two stages hold the weight (under FSDP2 the local shard: both sides are sharded alike over dp)."""
        if self.tied_group is None or self.tied is None or self.tied.grad is None:
            return None
        return local_tensor(self.tied.grad).clone()

    def _sync_tied_gradients(self, before: torch.Tensor | None) -> None:
        """The embedding (first stage) and the tied LM head (last stage) are one weight: sum what this step added to
        their gradients (a gradient accumulated over earlier steps is already the sum: adding it again would count
        it twice)."""
        if self.tied_group is None or self.tied is None or self.tied.grad is None:
            return
        grad = local_tensor(self.tied.grad)
        if before is None:
            dist.all_reduce(grad, group=self.tied_group)
            return
        added = grad - before
        dist.all_reduce(added, group=self.tied_group)
        torch.add(before, added, out=grad)


_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
)
_HEADER = 8  # dtype, number of dims, up to 6 sizes


def _send_tensors(tensors: tuple[torch.Tensor, ...], dst: int, group, device) -> None:
    """Send `tensors` to `dst`: their count, then each one's header (dtype, shape) and data."""
    dist.send(torch.tensor([len(tensors)], device=device), dst=dst, group=group)
    for tensor in tensors:
        header = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
        dist.send(torch.tensor(header + [0] * (_HEADER - len(header)), device=device), dst=dst, group=group)
        if tensor.numel():
            dist.send(tensor.detach().contiguous(), dst=dst, group=group)


def _recv_tensors(src: int, group, device) -> tuple[torch.Tensor, ...]:
    """The inverse of `_send_tensors`."""
    count = torch.zeros(1, dtype=torch.long, device=device)
    dist.recv(count, src=src, group=group)
    tensors = []
    for _ in range(int(count)):
        header = torch.zeros(_HEADER, dtype=torch.long, device=device)
        dist.recv(header, src=src, group=group)
        dtype, dims, *sizes = header.tolist()
        tensor = torch.empty(sizes[:dims], dtype=_DTYPES[dtype], device=device)
        if tensor.numel():
            dist.recv(tensor, src=src, group=group)
        tensors.append(tensor)
    return tuple(tensors)


NO_FORWARD = (
    "this model is pipeline-parallel: call model.run_train(**batch) (forward + backward, returns the loss) "
    "or model.run_eval(**batch) instead of model(**batch)"
)
NO_GENERATE = (
    "generate() is not supported on a pipeline-parallel model (pp > 1): decoding one token at a time through "
    "the stages is not implemented. Generate with a model parallelized without pipeline parallelism (tensor "
    "parallelism only, e.g. op.init_mesh(tp=N, pp=1)): save this one with save_model_checkpoint and load it "
    "back there (optimum-parallel reshard CKPT OUT --tp N --pp 1 converts the checkpoint); for logits, "
    "call model.run_eval(**batch)"
)


def _model_keys(entry: nn.Module) -> tuple[str, ...]:
    """The inputs beyond the token ids and the mask that a vision-language model's entry takes by name (its images,
    grids and token types)."""
    parameters = inspect.signature(type(entry).forward).parameters
    return tuple(name for name in parameters if name not in NOT_MODEL_INPUTS)


def apply_pipeline(
    model: nn.Module,
    mesh: ParallelMesh,
    split_spec: str | Mapping[str, SplitPoint],
    num_microbatches: int,
    schedule: str = "1f1b",
    *,
    batches: PipelineBatches | None = None,
    sequence: SequenceRegion | None = None,
) -> Pipeline:
    """Split `model` into stages for this rank's pp position, prune the rest, and attach run_train/run_eval.
    `batches`: how a whole batch becomes this rank's (default: as it is); `sequence`: the model's sequence-parallel
    region (stages exchange whole sequences; each stage after the first enters the region again at its first layer).
    A bad request raises (`check_pipeline`) before anything changes."""
    pp = mesh.size("pp")
    ranges = check_pipeline(model, pp, split_spec, num_microbatches, schedule)
    _, _, roles = decoder_parts(model, split_spec)
    per_rank, placement = SCHEDULES[schedule]
    num_stages = pp * per_rank
    indices = stage_indices(mesh.rank("pp"), pp, per_rank, placement)
    if ranks.global_rank() == 0:
        split = ", ".join(f"stage {i}: layers {r.start}-{r.stop - 1}" for i, r in enumerate(ranges))
        print(f"[optimum-parallel] pipeline {pp} ranks x {per_rank} stages ({schedule}): {split}")

    tied = getattr(model, roles.head).weight is getattr(roles.base, roles.embedding).weight
    batches = batches or PipelineBatches()
    language = LanguageInputs(deepstack_layers(model, roles.base), ranges) if roles.entry is not None else None
    per_layer = PerLayerInputs(ranges) if roles.per_layer else None
    stages = [
        DecoderStage(
            model, roles, ranges[index], index, num_stages, batches.stage_inputs, sequence, language, per_layer
        )
        for index in indices
    ]
    keep = {i for index in indices for i in ranges[index]}
    prune_to_stages(model, roles, keep, 0 in indices, num_stages - 1 in indices)
    model_keys = _model_keys(roles.entry) if roles.entry is not None else ()
    classifier = roles.head if roles.classifier else None
    pipeline = Pipeline(model, stages, mesh, schedule, num_microbatches, tied, batches, model_keys, classifier)
    parallel_state(model).pipeline = pipeline
    model.run_train = pipeline.run_train
    model.run_eval = pipeline.run_eval
    refuse(model, "forward", RuntimeError, NO_FORWARD)
    refuse(model, "generate", NotImplementedError, NO_GENERATE)
    return pipeline
