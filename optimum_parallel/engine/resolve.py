"""`resolve(request, model, mesh) -> ResolvedRequest`: every value the steps apply, decided once.

In two halves, so a family door can decide its family's part between them (`frontends/family_request.py`) and the
errors come in the order a caller meets them: `settle` needs no model (every setting checked, the mesh and the config
sections; the compile config made here, once), `resolve_settled` reads the model (what it supports, the plan as
checked, the pipeline's and data parallelism's defaults). Nothing here calls a family: the request carries what the
family decided (`plan`, `capabilities`, `after_plan`, the pipeline's `split_spec`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..autoplan.structure import derive_capabilities, state_mixers
from ..data_parallel.levels import DataParallelConfig
from ..mesh import ParallelMesh
from ..mixers import plan_mixer
from ..plan import check_plan
from .checks import check_on_mesh, check_settings
from .compile import CompileConfig
from .request import ParallelRequest, PipelineRequest, ResolvedRequest


@dataclass(frozen=True)
class SettledRequest:
    """A request whose settings, mesh and sections passed their checks, with its compile config (None: eager)."""

    request: ParallelRequest
    compile: CompileConfig | None


def settle(request: ParallelRequest, mesh: ParallelMesh) -> SettledRequest:
    """The half that needs no model: every setting (the compile config made once), then the mesh and sections."""
    compiled = check_settings(request)
    check_on_mesh(request, mesh)
    return SettledRequest(request, compiled)


def resolve_settled(settled: SettledRequest, model: nn.Module, mesh: ParallelMesh) -> ResolvedRequest:
    """The half that reads the model: what it supports (the family's declaration the request carries, else its
    structure's), the plan checked against it, the pipeline with its defaults (micro-batches: pp; None at pp=1), the
    data parallelism (a mesh section's cp or ep > 1 needs it: their gradients are partial per rank), how each token
    mixer carrying a state runs under cp."""
    request = settled.request
    capabilities = request.capabilities if request.capabilities is not None else derive_capabilities(model)
    targets = check_plan(model, request.plan, mesh) if request.plan else None
    mixers = tuple(plan_mixer(model, name, targets) for name in state_mixers(model))
    return ResolvedRequest(
        request=request,
        capabilities=capabilities,
        targets=targets,
        pipeline=_pipeline(request, mesh.size("pp")),
        data_parallel=_data_parallel(request, mesh),
        after_plan=request.after_plan,
        compile=settled.compile,
        mixers=mixers,
    )


def resolve(request: ParallelRequest, model: nn.Module, mesh: ParallelMesh) -> ResolvedRequest:
    """Both halves: `request` (its family's part already decided, if it came through a family door) resolved for
    `model` over `mesh`. Changes nothing; `checks.check` then checks what it decided."""
    return resolve_settled(settle(request, mesh), model, mesh)


def _pipeline(request: ParallelRequest, pp: int) -> PipelineRequest | None:
    """The pipeline to build, micro-batches defaulting to pp; None at pp=1."""
    pipeline = request.pipeline
    if pipeline is None or pp == 1:
        return None
    count = pipeline.num_microbatches if pipeline.num_microbatches is not None else pp
    return PipelineRequest(pipeline.split_spec, count, pipeline.schedule, pipeline.global_spec, pipeline.input_names)


def _data_parallel(request: ParallelRequest, mesh: ParallelMesh) -> DataParallelConfig | None:
    """The caller's data parallelism; without one, level 0 where a config section was named and cp or ep > 1: cp
    ranks' gradients are partial (each saw a share of the sequence), and ep ranks' expert gradients hold other ranks'
    tokens, so without data parallelism every rank would train on its own."""
    if request.data_parallel is None and request.sections and (mesh.size("cp") > 1 or mesh.size("ep") > 1):
        return DataParallelConfig()
    return request.data_parallel


__all__ = ["ResolvedRequest", "SettledRequest", "resolve", "resolve_settled", "settle"]
