"""Pipeline parallelism: hand-built stages of HF decoders on torch.distributed.pipelining schedules."""

from .runtime import SCHEDULES, Pipeline, PipelineOutput, apply_pipeline

__all__ = ["SCHEDULES", "Pipeline", "PipelineOutput", "apply_pipeline"]
