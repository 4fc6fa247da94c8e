"""The two request types: `ParallelRequest` (what a caller asked, from any entry point: `parallelize(...)`, the
Parallelizer, the Trainer; `keys` is the caller's name for each setting, so every error names it) and
`ResolvedRequest` (every value the steps apply, decided by `resolve.resolve` and accepted by `checks.validate`: what
`compose` takes). `PipelineSettings` is the pipeline part of either.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..autoplan.capabilities import Capabilities
from ..data_parallel.levels import DataParallelConfig
from ..mixers import MixerSpec
from ..pipeline.split import SplitPoint
from ..styles import ParallelStyle
from .compile import CompileConfig


@dataclass(frozen=True)
class RequestKeys:
    """What the caller calls each setting (the default: the Parallelizer's arguments)."""

    plan: str = "parallelize_plan"
    sequence_parallel: str = "sequence_parallel_enabled"
    split_spec: str = "split_spec"
    global_spec: str = "global_spec"
    schedule: str = "pipeline_parallel_schedule"
    num_microbatches: str = "pipeline_parallel_num_microbatches"
    input_names: str = "pipeline_parallel_input_names"
    context_parallel: str = "context_parallel_strategy"
    sharding_level: str = "sharding_level"
    shard_size: str = "dp_config['shard_size']"
    threshold: str = "dp_config['threshold']"
    reduce_dtype: str = "dp_config['reduce_dtype']"
    shared_batch: str = "shared_batch"
    compile: str = "compile"
    sizes: Mapping[str, str] = field(
        default_factory=lambda: {
            "tp": "tensor_parallel_size",
            "pp": "pipeline_parallel_size",
            "cp": "context_parallel_size",
            "ep": "expert_parallel_size",
        }
    )


PARALLELIZER_KEYS = RequestKeys()
CONFIG_KEYS = RequestKeys(  # parallelize(model, optimizer, mesh, config)
    plan="mp_config['parallelize_plan']",
    split_spec="pp_config['split_spec']",
    global_spec="pp_config['global_spec']",
    schedule="pp_config['schedule']",
    num_microbatches="pp_config['num_microbatches']",
    sharding_level="dp_config['sharding_level']",
    compile="config['compile']",
)
TRAINER_KEYS = RequestKeys(  # ParallelTrainingArguments
    sequence_parallel="sequence_parallel",
    schedule="pipeline_schedule",
    shard_size="shard_size",
    threshold="sharding_threshold_kb",
    compile="torch_compile",
)


@dataclass(frozen=True)
class PipelineSettings:
    """How to split the model into pipeline stages: `split_spec` (a layer-list prefix split evenly, or exact cuts);
    `num_microbatches` (None: pp); `schedule`; `global_spec` (a module every stage recomputes); `input_names`."""

    split_spec: str | Mapping[str, SplitPoint] | None = None  # None: the family's decoder layers
    num_microbatches: int | None = 1
    schedule: str = "1f1b"
    global_spec: str | None = None
    input_names: tuple[str, ...] | None = None


@dataclass(frozen=True)
class ParallelRequest:
    """Everything a caller asks of one parallelization (see the module docstring). `plan` is the caller's or the
    family's; `capabilities` what the model supports as its family declares it (None: derived from the model's
    structure); `after_plan` the family's fix-up of module attributes once the plan is applied; `sections` are the
    config sections a caller named (`parallelize(...)`'s: each needs a mesh dim to act on); `batch_sizes` and
    `gradient_accumulation_steps` are the Trainer's (micro-batches must divide the batches); `compile` is the
    caller's value (`engine/compile.py`'s `compile_config` reads it)."""

    plan: Mapping[str, Any] | None = None
    capabilities: Capabilities | None = None
    after_plan: Callable[[nn.Module, object], None] | None = None
    parallelize_embeddings: bool = True
    sequence_parallel: bool = False
    pipeline: PipelineSettings | None = None
    context_parallel: str = "ring"
    data_parallel: DataParallelConfig | None = None
    optimizer: torch.optim.Optimizer | None = None
    device: torch.device | str | None = None
    read_checkpoint: bool = True
    sections: tuple[str, ...] = ()
    mesh_sizes: Mapping[str, object] = field(default_factory=dict)
    batch_sizes: Mapping[str, int] = field(default_factory=dict)
    gradient_accumulation_steps: int = 1
    shared_batch: str = "check"  # the ranks of a batch replica: check they share the batch, broadcast it, or trust
    async_save: bool = False  # checkpoints written in the background (the Trainer's save_steps)
    push_to_hub: bool = False
    compile: object = None  # each decoder block compiled: True, a backend name, a dict or a CompileConfig
    keys: RequestKeys = PARALLELIZER_KEYS


@dataclass(frozen=True)
class ResolvedRequest:
    """A request with everything the steps apply decided once for one model and mesh (`resolve.resolve`): what the
    model supports, the plan resolved to the model's modules and checked (`module_styles`: {module name: its styles};
    None: no plan), the pipeline with its defaults filled
    (None without pp), the data parallelism to apply (None: none), the family's fix-up after the plan, how to compile
    the blocks (None: eager), and how each token mixer carrying a state runs under cp."""

    request: ParallelRequest
    capabilities: Capabilities
    module_styles: dict[str, list[ParallelStyle]] | None
    pipeline: PipelineSettings | None
    data_parallel: DataParallelConfig | None
    after_plan: Callable[[nn.Module, object], None] | None = None
    compile: CompileConfig | None = None
    mixers: tuple[MixerSpec, ...] = ()  # every token mixer carrying a state: how it runs under cp (mixers/plan.py)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.request.optimizer
