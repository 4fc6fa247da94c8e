"""The one typed record a parallel model carries: what each package set up, for the packages that read it.

The engine records what a composition installed (`runtime`, a frozen `engine.runtime.ParallelRuntime`); the fields
beside it are what packages set up and read again at forward time (context parallelism's settings, on the model and on
every attention module, and the cut of the forward running now; the pipeline; data parallelism's level and the dp x
cp gradient reduction). Each reader imports `parallel_state`, so the import map shows who reads what. A method a
layout cannot serve (`forward` under pp, `generate` under pp or cp) is replaced by one stand-in that raises the reason
recorded here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:  # annotations only: the record sits below every package that writes it
    from ..context_parallel.attention import ContextParallelAttention
    from ..engine.runtime import ParallelRuntime
    from ..expert_parallel.expert_split import ExpertParallelRuntime
    from ..pipeline.torch_pipelining import Pipeline

_KEY = "_optimum_parallel_state"


@dataclass
class ParallelState:
    # what the last composition installed (engine/compose.py): a second one reads it instead of installing again
    runtime: ParallelRuntime | None = None
    # kept here: every attention module carries it too (its forward reads it there), and the composition record
    # (`runtime`) is on the model only
    context_parallel: ContextParallelAttention | None = None  # set by context_parallel.apply_context_parallel
    # kept here: every cp forward writes it (the cut running now); the heads and gathers that follow it read it
    sequence_length: int | None = None  # cp: the whole sequence's length in the forward running now
    sequence_layout: object | None = None  # cp: which tokens every rank holds in that forward (context_parallel)
    # kept here: data parallelism sets it in the training half, after the model half's `runtime` is made; each cp
    # forward reads it
    gradients_reduced: bool = False  # set by data parallelism: the dp x cp reduction sums the cp ranks' gradients
    # kept here: read at run time by grad norms, data parallelism, TRL's head, `op.parallel_state(model).pipeline` users
    pipeline: Pipeline | None = None  # set by pipeline.apply_pipeline
    # kept here: expert parallelism's runtime on the model, read by validate (once) and by data parallelism (the
    # experts' reduction)
    expert_parallel: ExpertParallelRuntime | None = None  # set by expert_parallel.apply_expert_parallel
    # kept here: data parallelism sets it in the training half, after `runtime` is made; the replica watch reads it
    # at forward time
    data_parallel_level: int | None = None  # set by data parallelism: the sharding level it runs at
    # kept here: integrations/trl/fused_head.py reads it to raise the layout's own reason
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
