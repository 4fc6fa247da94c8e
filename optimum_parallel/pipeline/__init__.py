"""Pipeline parallelism: hand-built stages of HF decoders on torch.distributed.pipelining schedules."""

from .runtime import SCHEDULES, Pipeline, PipelineOutput, apply_pipeline, check_pipeline, check_schedule
from .split import SplitPoint

__all__ = [
    "SCHEDULES",
    "Pipeline",
    "PipelineOutput",
    "SplitPoint",
    "apply_pipeline",
    "check_pipeline",
    "check_schedule",
]
