"""What a composition installed, as one frozen record: `compose` returns it, and the model keeps the one its model half
made (`ParallelState.runtime`), which a second composition of the same model reads instead of installing again."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # annotations only: the packages below are imported by the steps that install them
    from ..comm.tp_entry import SequenceRegion
    from ..context_parallel.attention import ContextParallelAttention
    from ..expert_parallel.expert_split import ExpertParallelRuntime
    from ..pipeline.torch_pipelining import Pipeline
    from .compile import CompileConfig

ParamMap = dict[int, nn.Parameter | None]  # {id(original parameter): parallel parameter, or None on another stage}


@dataclass(frozen=True)
class ParallelRuntime:
    """The parallel model as composed: `model` (the data-parallel one after `compose`; the model itself after
    `compose_model`), `optimizer` (over the parallel parameters; None after `compose_model`), `param_map` for an
    optimizer built before, `tensor_parallel_layers` ({module name: COLUMN or ROW}, the plan's) and `sequence` (its
    sequence-parallel region), the expert/context/pipeline runtimes (None where that dimension is 1), whether the
    packed-rows hook and the guards (shared batch, replica watch, whole-model save) are on the model, the compile
    config of its blocks (None: eager), and the data-parallel sharding level (None: no data parallelism, or the
    Trainer's model half)."""

    model: nn.Module
    param_map: ParamMap
    tensor_parallel_layers: Mapping[str, str] = field(default_factory=dict)
    sequence: SequenceRegion | None = None
    expert_parallel: ExpertParallelRuntime | None = None
    context_parallel: ContextParallelAttention | None = None
    pipeline: Pipeline | None = None
    packing: bool = False
    guarded: bool = False
    compile: CompileConfig | None = None
    optimizer: torch.optim.Optimizer | None = None
    data_parallel_level: int | None = None
