"""The one typed record a parallel model carries: what each room set up, for the rooms that read it.

Context parallelism records its settings (on the model and on every attention module), the pipeline its runtime,
data parallelism that the dp x cp gradient reduction is installed, the front doors the parameter map. Each reader
imports `parallel_state`, so the import map shows who reads what. A method a layout cannot serve (`forward` under
pp, `generate` under pp or cp) is replaced by one stand-in that raises the reason recorded here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:  # annotations only: the record sits below every room that writes it
    from ..context_parallel.attention import ContextParallelAttention
    from ..expert_parallel.expert_split import ExpertParallelRuntime
    from ..pipeline.runtime import Pipeline

_KEY = "_optimum_parallel_state"


@dataclass
class ParallelState:
    context_parallel: ContextParallelAttention | None = None  # set by context_parallel.apply_context_parallel
    sequence_length: int | None = None  # cp: the whole sequence's length in the forward running now
    sequence_layout: object | None = None  # cp: which tokens every rank holds in that forward (context_parallel)
    gradients_reduced: bool = False  # set by data parallelism: the dp x cp reduction sums the cp ranks' gradients
    pipeline: Pipeline | None = None  # set by pipeline.apply_pipeline
    expert_parallel: ExpertParallelRuntime | None = None  # set by expert_parallel.apply_expert_parallel
    param_map: dict[int, nn.Parameter | None] | None = None  # {id(original parameter): parallel one}, the front doors
    data_parallel_level: int | None = None  # set by data parallelism: the sharding level it runs at
    packing: bool = False  # the packed-rows forward pre-hook is installed (engine/compose.py, packing/)
    guarded: bool = False  # the shared-batch and replica checks are installed (engine/shared_batch.py, replicas.py)
    unsupported: dict[str, str] = field(default_factory=dict)  # method name -> why this layout cannot serve it


def parallel_state(module: nn.Module) -> ParallelState:
    """`module`'s record, created empty on first use (kept in `__dict__`: not a submodule, not a buffer)."""
    state = module.__dict__.get(_KEY)
    if state is None:
        state = module.__dict__[_KEY] = ParallelState()
    return state


def find_state(module: nn.Module) -> ParallelState | None:
    """`module`'s record if something was recorded on it, else None (reads create nothing)."""
    return module.__dict__.get(_KEY)


def refuse(module: nn.Module, method: str, error: type[Exception], message: str) -> None:
    """Make `module.<method>(...)` raise `error(message)` (an instance attribute over the class's method)."""
    parallel_state(module).unsupported[method] = message

    def unsupported(*args, **kwargs):
        raise error(message)

    unsupported.__name__ = method
    setattr(module, method, unsupported)
