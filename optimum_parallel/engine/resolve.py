"""`resolve(request, model, mesh) -> ResolvedRequest`: every value the steps apply, decided once from a request whose
settings and mesh passed `checks.check_settings` / `check_on_mesh`: the compile config, what the model supports, the
plan resolved to its modules and checked, the pipeline's and data parallelism's defaults, how each state mixer runs
under cp. Nothing here calls a family: the request carries what the family decided (`plan`, `capabilities`,
`after_plan`, the pipeline's `split_spec`).
"""

from __future__ import annotations

from torch import nn

from ..autoplan.structure import derive_capabilities, state_mixers
from ..data_parallel.levels import DataParallelConfig
from ..mesh import ParallelMesh
from ..mixers import plan_mixer
from ..plan import check_plan
from .compile import compile_config
from .request import ParallelRequest, PipelineSettings, ResolvedRequest


def resolve(request: ParallelRequest, model: nn.Module, mesh: ParallelMesh) -> ResolvedRequest:
    """`request` (its family's part already decided, for a family entry point) resolved for `model` over `mesh`:
    how to compile the blocks (None: eager), what the model supports (the family's declaration the request carries,
    else its structure's), the plan checked against it, the pipeline with its defaults (micro-batches: pp; None at
    pp=1), the data parallelism (a config section's cp or ep > 1 needs it: their gradients are partial per rank), how
    each token mixer carrying a state runs under cp. Changes nothing; `checks.check` then checks what it decided."""
    capabilities = request.capabilities if request.capabilities is not None else derive_capabilities(model)
    module_styles = check_plan(model, request.plan, mesh) if request.plan else None
    mixers = tuple(plan_mixer(model, name, module_styles) for name in state_mixers(model))
    return ResolvedRequest(
        request=request,
        capabilities=capabilities,
        module_styles=module_styles,
        pipeline=_pipeline(request, mesh.size("pp")),
        data_parallel=_data_parallel(request, mesh),
        after_plan=request.after_plan,
        compile=compile_config(request.compile, request.keys.compile),
        mixers=mixers,
    )


def _pipeline(request: ParallelRequest, pp: int) -> PipelineSettings | None:
    """The pipeline to build, micro-batches defaulting to pp; None at pp=1."""
    pipeline = request.pipeline
    if pipeline is None or pp == 1:
        return None
    count = pipeline.num_microbatches if pipeline.num_microbatches is not None else pp
    return PipelineSettings(pipeline.split_spec, count, pipeline.schedule, pipeline.global_spec, pipeline.input_names)


def _data_parallel(request: ParallelRequest, mesh: ParallelMesh) -> DataParallelConfig | None:
    """The caller's data parallelism; without one, level 0 where a config section was named and cp or ep > 1: cp
    ranks' gradients are partial (each saw a share of the sequence), and ep ranks' expert gradients hold other ranks'
    tokens, so without data parallelism every rank would train on its own."""
    if request.data_parallel is None and request.sections and (mesh.size("cp") > 1 or mesh.size("ep") > 1):
        return DataParallelConfig()
    return request.data_parallel


__all__ = ["ResolvedRequest", "resolve"]
