"""ParallelTrainingArguments: `transformers.TrainingArguments` plus the mesh and parallelism settings."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from transformers import TrainingArguments
from transformers.utils import is_torch_xla_available

from ...context_parallel import STRATEGIES as CP_STRATEGIES
from ...context_parallel import check_strategy
from ...engine.data_parallel import DataParallelConfig, check_sharding_level
from ...mesh import check_positive_int, ranks
from ...mesh.rendezvous import init_before_accelerate
from ...pipeline import SCHEDULES, check_schedule


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
    pipeline_parallel_num_microbatches: int = field(
        default=1, metadata={"help": "Micro-batches each per-device batch is cut into under pp (>= pp)."}
    )
    pipeline_schedule: str = field(default="1f1b", metadata={"help": f"One of: {', '.join(SCHEDULES)}."})
    async_save: bool = field(
        default=False,
        metadata={
            "help": "Write save_steps checkpoints in the background: each rank copies its shards (and RNG, scheduler, "
            "state) to host memory in the step (one copy of its weights and optimizer state, freed once written); "
            "the next save, save_model() and the end of training wait for it and raise its error."
        },
    )

    def __post_init__(self) -> None:
        world = _launched_world_size()
        if world > 1 and not self.use_cpu and _no_accelerator():
            # accelerate makes a multi-process CPU run distributed only with cpu=True; without it every rank is
            # process 0 of 1, and the Trainer's loss scale (processes // ranks sharing a batch) is 1 // tp = 0
            self.use_cpu = True
            if self.ddp_backend is None:
                self.ddp_backend = "gloo"
        init_before_accelerate(self.ddp_backend, self.use_cpu, self.ddp_timeout)  # restarts: see mesh/rendezvous.py
        super().__post_init__()  # creates the distributed state (accelerate's PartialState)
        if world > 1 and self.world_size != world:
            kind = getattr(self.distributed_state, "distributed_type", None)
            raise ValueError(
                f"{world} processes were launched, but transformers/accelerate set up {self.world_size} on device "
                f"{self.device} (distributed type {kind}); the Trainer would scale "
                "losses and batches wrongly. Add use_cpu=True (--use_cpu) to train on CPU with gloo, or run on an "
                "accelerator accelerate distributes over"
            )
        check_positive_int("tensor_parallel_size", self.tensor_parallel_size)
        check_positive_int("pipeline_parallel_size", self.pipeline_parallel_size)
        check_positive_int("context_parallel_size", self.context_parallel_size)
        check_positive_int("expert_parallel_size", self.expert_parallel_size)
        check_positive_int("pipeline_parallel_num_microbatches", self.pipeline_parallel_num_microbatches)
        check_sharding_level(self.sharding_level, "sharding_level")
        _check_hybrid_sharding(self)
        check_strategy(self.context_parallel_strategy, "context_parallel_strategy")
        check_schedule(self.pipeline_schedule, "pipeline_schedule")
        if self.pipeline_parallel_size == 1:
            if self.pipeline_parallel_num_microbatches != 1:
                raise ValueError(
                    f"pipeline_parallel_num_microbatches={self.pipeline_parallel_num_microbatches} needs "
                    "pipeline_parallel_size > 1; allowed with pipeline_parallel_size=1: 1"
                )
            return
        # the pipeline accumulates over its micro-batches: Trainer-side accumulation would scale wrongly
        if self.gradient_accumulation_steps != 1:
            raise ValueError(
                f"gradient_accumulation_steps={self.gradient_accumulation_steps} is not allowed with "
                "pipeline_parallel_size > 1; allowed: 1 (raise pipeline_parallel_num_microbatches instead)"
            )
        if self.pipeline_parallel_num_microbatches < self.pipeline_parallel_size:
            raise ValueError(
                f"pipeline_parallel_num_microbatches={self.pipeline_parallel_num_microbatches} is not allowed; "
                f"it must be >= pipeline_parallel_size={self.pipeline_parallel_size}"
            )
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size"):
            if getattr(self, name) % self.pipeline_parallel_num_microbatches:
                raise ValueError(
                    f"{name}={getattr(self, name)} is not allowed: it must be a multiple of "
                    f"pipeline_parallel_num_microbatches={self.pipeline_parallel_num_microbatches}"
                )


def _launched_world_size() -> int:
    """Processes in the job: the process group's size, else torchrun's WORLD_SIZE."""
    return ranks.world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def _no_accelerator() -> bool:
    """No device accelerate could distribute over (CUDA, XPU, NPU, HPU, MPS, ..., or XLA): a CPU-only machine."""
    return torch.accelerator.current_accelerator() is None and not is_torch_xla_available()


def _check_hybrid_sharding(args: ParallelTrainingArguments) -> None:
    """shard_size and sharding_threshold_kb, checked by `DataParallelConfig` (its errors renamed to these keys);
    whether shard_size divides dp x cp is checked once the mesh exists."""
    try:
        DataParallelConfig(args.sharding_level, shard_size=args.shard_size, threshold=args.sharding_threshold_kb)
    except ValueError as err:
        message = str(err).replace("dp_config['shard_size'] = ", "shard_size=")
        message = message.replace("dp_config['threshold'] = ", "sharding_threshold_kb=")
        raise ValueError(message) from None
