"""Parallel styles: the values of a plan, each saying how one module is parallelized."""

from .base import ParallelStyle, PlanContext, optional
from .conv import DepthwiseConvParallel
from .expert_parallel import ExpertParallel
from .fused import ColWiseConv1D, PackedColWiseParallel, RowWiseConv1D
from .hooks import PrepareLayerInput, PrepareLayerOutput, ReplicatedWithGradAllReduce
from .latent_attention import LatentKeyValueProjection
from .linear import ColWiseParallel, LocalColWiseEmbedding, RowWiseParallel, TiedBiasColWiseParallel
from .parameter import SplitParameter
from .sequence_parallel import (
    SequenceParallelBegin,
    SequenceParallelDisable,
    SequenceParallelEnable,
    SequenceParallelEnd,
    SequenceParallelSplitArgument,
)
from .tp_experts import IdentityExpertParallel, TensorParallelExperts

__all__ = [
    "ColWiseConv1D",
    "ColWiseParallel",
    "DepthwiseConvParallel",
    "ExpertParallel",
    "LocalColWiseEmbedding",
    "PackedColWiseParallel",
    "ParallelStyle",
    "PlanContext",
    "PrepareLayerInput",
    "PrepareLayerOutput",
    "ReplicatedWithGradAllReduce",
    "RowWiseConv1D",
    "RowWiseParallel",
    "SequenceParallelBegin",
    "SequenceParallelDisable",
    "SequenceParallelEnable",
    "SequenceParallelEnd",
    "SequenceParallelSplitArgument",
    "SplitParameter",
    "TensorParallelExperts",
    "IdentityExpertParallel",
    "LatentKeyValueProjection",
    "TiedBiasColWiseParallel",
    "optional",
]
