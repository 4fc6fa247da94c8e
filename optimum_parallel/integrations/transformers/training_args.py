"""ParallelTrainingArguments: `transformers.TrainingArguments` plus the mesh and parallelism settings."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from transformers import TrainingArguments
from transformers.utils import is_torch_xla_available

from ...context_parallel import STRATEGIES as CP_STRATEGIES
from ...data_parallel.levels import DataParallelConfig
from ...engine.checks import check_settings
from ...engine.compile import CompileConfig
from ...engine.request import TRAINER_KEYS, ParallelRequest, PipelineSettings
from ...mesh import device as devices
from ...mesh import launchers, ranks
from ...mesh.rendezvous import init_before_accelerate
from ...pipeline import SCHEDULES

logger = logging.getLogger(__name__)


@dataclass
class ParallelTrainingArguments(TrainingArguments):
    """TrainingArguments for `ParallelTrainer`; the data-parallel size is what is left: world / (tp * pp * cp)."""

    tensor_parallel_size: int = field(default=1, metadata={"help": "Ranks each layer is split over (tp)."})
    pipeline_parallel_size: int = field(default=1, metadata={"help": "Pipeline stages the layers are cut into (pp)."})
    context_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Ranks each sequence is split over (cp, ring attention); they hold the same weights and get the "
            "same batches, so per_device_*_batch_size is per dp replica as without cp."
        },
    )
    expert_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Ranks the experts of a mixture-of-experts model are split over (ep); consecutive dp x cp ranks, "
            "so ep divides world / (tp * pp); tokens reach their experts by all-to-all."
        },
    )
    context_parallel_strategy: str = field(
        default="ring",
        metadata={"help": f"Attention over the cp ranks: {', '.join(CP_STRATEGIES)} (all_to_all: heads divide by cp)."},
    )
    sequence_parallel: bool = field(default=False, metadata={"help": "Split activations along the sequence in tp."})
    sharding_level: int = field(
        default=0,
        metadata={
            "help": "Data parallelism: 0 replicate, 1 + optimizer state sharded (ZeRO-1), 2 + gradients "
            "sharded (FSDP2), 3 + parameters sharded (FSDP2, resharded after forward)."
        },
    )
    shard_size: int = field(
        default=-1,
        metadata={
            "help": "Ranks per sharding group at sharding_level 1-3 (hybrid sharding, MindSpore's hsdp): -1 all "
            "dp x cp ranks; else a divisor of dp x cp: shard inside each group, replicate across groups."
        },
    )
    sharding_threshold_kb: float = field(
        default=0,
        metadata={"help": "At sharding_level 2-3, parameters smaller than this many KB stay whole on every rank."},
    )
    pipeline_parallel_num_microbatches: int | None = field(
        default=None,
        metadata={
            "help": "Micro-batches each per-device batch is cut into under pp (>= pp). Default: as many as the train "
            "and eval batches both divide into (their gcd: one sample each with equal batch sizes); "
            "gradient_accumulation_steps under pp multiplies them (see fold_accumulation_into_pipeline)."
        },
    )
    pipeline_schedule: str = field(default="1f1b", metadata={"help": f"One of: {', '.join(SCHEDULES)}."})
    shared_batch: str = field(
        default="check",
        metadata={
            "help": "How the ranks of one batch replica (tp, cp, pp) get their batch: check that they hold the same "
            "one (on new input shapes and every 100 steps), broadcast the first rank's, or trust the loader."
        },
    )
    async_save: bool = field(
        default=False,
        metadata={
            "help": "Write save_steps checkpoints in the background: each rank snapshots its shards in host memory "
            "(its RNG, scheduler and state in the step; its weights and optimizer state copied while the next step's "
            "forward and backward run, its optimizer step waiting for the copy; freed once written); the next save, "
            "save_model() and the end of training wait for it and raise its error."
        },
    )

    def __post_init__(self) -> None:
        # ddp_timeout is every collective's timeout in every phase while the heartbeat runs (mesh/heartbeat.py); without
        # it, until the first optimizer step ends and around saves and loads, min(2 minutes, ddp_timeout) in between
        check_ddp_timeout(self.ddp_timeout)
        world = _launched_world_size()
        if world > 1 and not self.use_cpu and _no_accelerator():
            # accelerate makes a multi-process CPU run distributed only with cpu=True; without it every rank is
            # process 0 of 1, and the Trainer's loss scale (processes // ranks sharing a batch) is 1 // tp = 0
            self.use_cpu = True
            if self.ddp_backend is None:
                self.ddp_backend = "gloo"
        init_before_accelerate(self.ddp_backend, self.use_cpu, self.ddp_timeout)  # restarts: see mesh/rendezvous.py
        super().__post_init__()  # creates the distributed state (accelerate's PartialState)
        if self.dataloader_pin_memory and devices.lacks_pinned_memory():
            self.dataloader_pin_memory = False  # the Trainer's DataLoader would raise on its first batch
        if world > 1 and self.world_size != world:
            kind = getattr(self.distributed_state, "distributed_type", None)
            raise ValueError(
                f"{world} processes were launched, but transformers/accelerate set up {self.world_size} on device "
                f"{self.device} (distributed type {kind}); the Trainer would scale "
                "losses and batches wrongly. Add use_cpu=True (--use_cpu) to train on CPU with gloo, or run on an "
                "accelerator accelerate distributes over"
            )
        fold_accumulation_into_pipeline(self)
        check_settings(trainer_request(self))  # the request these arguments make, checked before any model exists


def fold_accumulation_into_pipeline(args: ParallelTrainingArguments) -> None:
    """Give `pipeline_parallel_num_microbatches` its default and fold `gradient_accumulation_steps` into it under pp.

    Under pp, k > 1 accumulation steps become one schedule: the per-device train batch k times larger and the
    accumulation steps 1, so an optimizer step sees the same samples (the sampler's next k batches, as one) and the
    same loss, the token mean of the global batch, with one pipeline bubble instead of k. A micro-batch count set
    explicitly is multiplied by k (each micro-batch keeps its size). The default (None): 1 without pp; under pp,
    gcd(per-device train batch after the fold, eval batch), the most micro-batches both batches cut into (the
    smallest bubble and micro-batch memory; one sample each when they are equal), which must be >= pp. Idempotent:
    arguments folded once stay as they are."""
    pp, steps = args.pipeline_parallel_size, args.gradient_accumulation_steps
    micro, key = args.pipeline_parallel_num_microbatches, "pipeline_parallel_num_microbatches"
    if not isinstance(pp, int) or pp <= 1:
        args.pipeline_parallel_num_microbatches = 1 if micro is None else micro
        return
    train, evaluation = args.per_device_train_batch_size, args.per_device_eval_batch_size
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (steps, train, evaluation)):
        return  # check_settings names the bad value
    if micro is not None and isinstance(micro, int) and train % micro:
        raise ValueError(f"per_device_train_batch_size={train} is not allowed: it must be a multiple of {key}={micro}")
    if steps > 1:
        args.per_device_train_batch_size, args.gradient_accumulation_steps = train * steps, 1
        micro = micro * steps if isinstance(micro, int) else None
        logger.info(
            f"gradient_accumulation_steps={steps} with pipeline_parallel_size={pp}: folded into one pipeline schedule "
            f"(per_device_train_batch_size {train} -> {train * steps}, gradient_accumulation_steps -> 1)"
        )
    if micro is None:
        micro = math.gcd(args.per_device_train_batch_size, evaluation)
        if micro < pp:
            raise ValueError(
                f"pipeline_parallel_size={pp} needs at least {pp} micro-batches, and the per-device batches (train "
                f"{args.per_device_train_batch_size}, eval {evaluation}) divide into at most {micro}: raise "
                f"per_device_train_batch_size, per_device_eval_batch_size or gradient_accumulation_steps to a "
                f"multiple of {pp}, or set {key}"
            )
    args.pipeline_parallel_num_microbatches = micro


def trainer_request(
    args: ParallelTrainingArguments,
    optimizer: torch.optim.Optimizer | None = None,
    device: torch.device | str | None = None,
) -> ParallelRequest:
    """The Trainer's arguments as one request, named as the Trainer names them (the model's Parallelizer decides the
    plan: `frontends/family_request.py`)."""
    pipeline = PipelineSettings(None, args.pipeline_parallel_num_microbatches, args.pipeline_schedule)
    data_parallel = DataParallelConfig(
        args.sharding_level, shard_size=args.shard_size, threshold=args.sharding_threshold_kb
    )
    return ParallelRequest(
        sequence_parallel=args.sequence_parallel,
        pipeline=pipeline,
        context_parallel=args.context_parallel_strategy,
        data_parallel=data_parallel,
        optimizer=optimizer,
        device=device,
        mesh_sizes={
            "tp": args.tensor_parallel_size,
            "pp": args.pipeline_parallel_size,
            "cp": args.context_parallel_size,
            "ep": args.expert_parallel_size,
        },
        batch_sizes={
            name: getattr(args, name) for name in ("per_device_train_batch_size", "per_device_eval_batch_size")
        },
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        shared_batch=args.shared_batch,
        async_save=args.async_save,
        push_to_hub=args.push_to_hub,
        compile=_compile_setting(args),
        keys=TRAINER_KEYS,
    )


def _compile_setting(args: ParallelTrainingArguments) -> CompileConfig | None:
    """`torch_compile` with its backend and mode: each decoder block compiled (not the whole model, which the Trainer
    would hand to accelerate); static shapes for the neuron backend, as transformers asks of it."""
    if not args.torch_compile:
        return None
    backend = args.torch_compile_backend or "inductor"
    return CompileConfig(backend, args.torch_compile_mode, devices.compile_dynamic(backend))


def check_ddp_timeout(value: object) -> None:
    """`ddp_timeout` must be seconds > 0: it becomes every process group's timeout (one error, on every rank)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(
            f"ddp_timeout={value!r}: the process groups' timeout must be a number of seconds > 0 (allowed: > 0; it "
            "is every collective's timeout)"
        )


def _launched_world_size() -> int:
    """Processes in the job: the process group's size, else the launcher's (torchrun, srun, mpirun: launchers.py)."""
    return ranks.world_size() if dist.is_initialized() else launchers.detect().world_size


def _no_accelerator() -> bool:
    """No device accelerate could distribute over (CUDA, XPU, NPU, HPU, MPS, ..., or XLA): a CPU-only machine."""
    return devices.current_accelerator() is None and not is_torch_xla_available()
