"""Pipeline parallelism: hand-built stages of HF decoders on torch.distributed.pipelining schedules.

The runtime (`Pipeline`, `apply_pipeline`) loads on first use: torch's pipelining imports `torch._dynamo`.
"""

from .schedules import SCHEDULES, SPLIT_BACKWARD, check_pipeline, check_schedule
from .split import SplitPoint

_RUNTIME = ("Pipeline", "PipelineOutput", "apply_pipeline")


def __getattr__(name: str):
    if name in _RUNTIME:
        from . import torch_pipelining

        return getattr(torch_pipelining, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["SCHEDULES", "SPLIT_BACKWARD", "SplitPoint", "check_pipeline", "check_schedule", *_RUNTIME]
