"""What the memory planner is asked about: a layout of dp x tp x pp x cp devices, the workload of one training step,
and the per-rank estimate it answers with."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..data_parallel.levels import DataParallelConfig
from ..engine.checks import check_data_parallel_config, check_expert_data_parallel, check_shard_size
from ..engine.request import RequestKeys
from ..mesh import check_expert_parallel_size, check_positive_int

GIB = 1024**3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float": "fp32"}
ATTENTION = ("sdpa", "eager")
ACTIVATION_METHODS = ("auto", "llama", "paper")
SCHEDULES = ("1f1b", "gpipe")
PLANNER_KEYS = RequestKeys(  # what `estimate_memory`, `Layout` and `Workload` call each setting the engine checks
    sequence_parallel="sequence_parallel",
    schedule="schedule",
    num_microbatches="num_microbatches",
    shard_size="shard_size",
    sizes={"tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep"},
)


def parse_dtype(dtype: str | torch.dtype) -> str:
    """'fp32' | 'bf16' | 'fp16' from a name or a torch dtype; ValueError names the allowed values."""
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not allowed; allowed: {', '.join(DTYPES)}")
    return name


@dataclass(frozen=True)
class Layout:
    """One way to lay a model over dp x tp x pp x cp devices (cp: context parallelism, the sequence split; ep:
    expert parallelism, the experts split over blocks of ep of the dp x cp ranks, which it divides; it composes
    with pp and every sharding level, not with hybrid sharding, as the engine runs it)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    sharding_level: int = 0
    sequence_parallel: bool = False
    cp: int = 1
    shard_size: int = -1  # ranks per sharding group (hybrid sharding); -1: all dp x cp
    ep: int = 1  # ranks the experts are split over (a divisor of dp x cp)

    def __post_init__(self) -> None:  # the engine's own checks of these settings, naming the planner's keys
        for name in ("dp", "tp", "pp", "cp"):
            check_positive_int(name, getattr(self, name), "a size")
        check_data_parallel_config(DataParallelConfig(self.sharding_level, shard_size=self.shard_size), PLANNER_KEYS)
        check_shard_size(self.shard_size, self.data_parallel, "shard_size")
        check_expert_parallel_size(self.ep, self.data_parallel, "ep", f"dp x cp = {self.dp} x {self.cp}")
        check_expert_data_parallel(self.shard_size, self.ep, "shard_size")

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def mesh_sizes(self) -> dict[str, int]:
        """The mesh this layout runs on: {dim: size} over dp, pp, cp, tp and ep."""
        return {"dp": self.dp, "pp": self.pp, "cp": self.cp, "tp": self.tp, "ep": self.ep}

    @property
    def data_parallel(self) -> int:
        """Ranks holding the same parameters, over which sharding levels 1-3 split them: dp x cp."""
        return self.dp * self.cp

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts (dp x cp / ep), over which sharding levels 1-3 split the expert states."""
        return self.data_parallel // self.ep

    @property
    def sharding_group(self) -> int:
        """Ranks sharding levels 1-3 split the states over: `shard_size`, or all dp x cp when it is -1 (hybrid
        sharding replicates across the groups)."""
        return self.data_parallel if self.shard_size == -1 else self.shard_size

    def __str__(self) -> str:
        sp = ", SP" if self.sequence_parallel else ""
        group = f" in groups of {self.shard_size}" if self.sharding_group < self.data_parallel else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        return f"dp={self.dp} tp={self.tp} pp={self.pp} cp={self.cp}{ep} level {self.sharding_level}{group}{sp}"


@dataclass(frozen=True)
class Workload:
    """What one training step runs: tokens per micro-batch, precision, attention kernel."""

    seq_len: int = 2048
    micro_batch: int = 1
    num_microbatches: int | None = None  # pipeline micro-batches per step (default: pp)
    schedule: str = "1f1b"  # pipeline schedule: "1f1b" or "gpipe"
    dtype: str = "bf16"
    master_weights: bool | None = None  # default: True for 16-bit dtypes
    attention: str = "sdpa"
    activations: str = "auto"
    async_save: bool = False  # checkpoints written in the background: a snapshot of the shards in host memory

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        for name in ("seq_len", "micro_batch"):
            check_positive_int(name, getattr(self, name))
        if self.attention not in ATTENTION:
            raise ValueError(f"attention={self.attention!r} is not allowed; allowed: {', '.join(ATTENTION)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not allowed; allowed: {', '.join(SCHEDULES)}")
        if self.activations not in ACTIVATION_METHODS:
            raise ValueError(f"activations={self.activations!r}; allowed: {', '.join(ACTIVATION_METHODS)}")

    @property
    def element(self) -> int:
        return torch.empty((), dtype=DTYPES[self.dtype]).element_size()

    @property
    def uses_master_weights(self) -> bool:
        if self.dtype == "fp32":
            return False
        return True if self.master_weights is None else self.master_weights

    @property
    def optimizer_bytes_per_param(self) -> int:
        """AdamW state bytes per parameter: m and v (+ the fp32 master copy)."""
        return 12 if self.uses_master_weights else 2 * self.element


@dataclass
class MemoryEstimate:
    """Bytes on the rank with the most of them (each line is that line's maximum over ranks)."""

    layout: Layout
    workload: Workload
    parameters: float
    gradients: float
    optimizer_state: float
    buffers: float
    activations: float
    activations_paper: float
    activations_llama: float | None
    activation_method: str
    notes: list[str] = field(default_factory=list)
    snapshot: float = 0.0  # host memory, not in `total`: an async save's copy of a writing rank's shards

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state + self.buffers + self.activations

    @property
    def states(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state
