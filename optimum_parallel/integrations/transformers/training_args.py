"""ParallelTrainingArguments: `transformers.TrainingArguments` plus the mesh and parallelism settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from ...context_parallel import STRATEGIES as CP_STRATEGIES
from ...engine.data_parallel import SHARDING_LEVELS, DataParallelConfig
from ...mesh import check_positive_int
from ...pipeline import SCHEDULES


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

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int("tensor_parallel_size", self.tensor_parallel_size)
        check_positive_int("pipeline_parallel_size", self.pipeline_parallel_size)
        check_positive_int("context_parallel_size", self.context_parallel_size)
        check_positive_int("pipeline_parallel_num_microbatches", self.pipeline_parallel_num_microbatches)
        if isinstance(self.sharding_level, bool) or self.sharding_level not in SHARDING_LEVELS:
            raise ValueError(f"sharding_level={self.sharding_level!r} is not allowed; allowed: 0, 1, 2, 3")
        _check_hybrid_sharding(self)
        if self.context_parallel_strategy not in CP_STRATEGIES:
            raise ValueError(
                f"context_parallel_strategy={self.context_parallel_strategy!r} is not allowed; allowed: "
                f"{', '.join(CP_STRATEGIES)}"
            )
        if self.pipeline_schedule not in SCHEDULES:
            raise ValueError(
                f"pipeline_schedule={self.pipeline_schedule!r} is not allowed; allowed: {', '.join(SCHEDULES)}"
            )
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


def _check_hybrid_sharding(args: ParallelTrainingArguments) -> None:
    """shard_size and sharding_threshold_kb, checked by `DataParallelConfig` (its errors renamed to these keys);
    whether shard_size divides dp x cp is checked once the mesh exists."""
    try:
        DataParallelConfig(args.sharding_level, shard_size=args.shard_size, threshold=args.sharding_threshold_kb)
    except ValueError as err:
        message = str(err).replace("dp_config['shard_size'] = ", "shard_size=")
        message = message.replace("dp_config['threshold'] = ", "sharding_threshold_kb=")
        raise ValueError(message) from None
