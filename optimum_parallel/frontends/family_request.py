"""A family's part of a request, decided before the engine resolves it, so the engine never calls a family.

The Parallelizer, the Trainer and TRL's trainers choose a family (a `Parallelizer` class) for the model; here it makes
its plan, declares what the model supports and gives its fix-up after the plan, as values of the request. They pass
`partial(family_request, family)` to `engine.checks.validate`, which runs it after the settings and mesh checks.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from torch import nn

from ..engine.checks import check_capabilities
from ..engine.request import ParallelRequest
from ..mesh import ParallelMesh
from ..styles import SequenceParallelEnd, optional

if TYPE_CHECKING:  # the Parallelizer calls these: the class is only an annotation here
    from .parallelizer import Parallelizer


def family_request(
    family: type[Parallelizer], request: ParallelRequest, model: nn.Module, mesh: ParallelMesh
) -> ParallelRequest:
    """`request` with `family`'s part filled for `model` over `mesh`: the pipeline's split (the family's decoder
    layers, where the caller named none), what the model supports (checked against sequence and pipeline
    parallelism), the family's own check, its plan and its after-plan fix-up."""
    pipeline, pp = request.pipeline, mesh.size("pp")
    if pipeline is not None and pp > 1 and pipeline.split_spec is None:
        pipeline = replace(pipeline, split_spec=family.pipeline_split_spec(model))
    capabilities = family.capabilities_for(model)
    check_capabilities(request, capabilities, pp, family.__name__)
    family.check(model, mesh)
    plan = family.plan(model, mesh, request.parallelize_embeddings, request.sequence_parallel)
    if request.sequence_parallel:
        plan = _with_classifier_head(model, plan)
    return replace(request, plan=plan, pipeline=pipeline, capabilities=capabilities, after_plan=family.after_plan)


def _with_classifier_head(model: nn.Module, plan: dict) -> dict:
    """A sequence-classification head (transformers' `score`, replicated) scores every token, then pools the last
    non-padding one of each row: under sp it must see the whole sequence, gathered at its input (split backward), as
    the LM head does; the families' plans only name `lm_head`."""
    if not isinstance(getattr(model, "score", None), nn.Linear) or "score" in plan:
        return plan
    return {**plan, "score": optional(SequenceParallelEnd())}
