"""Parallel styles: the values of a plan, each saying how one module is parallelized."""

from .base import ParallelStyle, PlanContext, optional
from .conv import DepthwiseConvParallel
from .expert_parallel import ExpertParallel
from .experts import IdentityExpertParallel, TensorParallelExperts
from .hooks import PrepareLayerInput, PrepareLayerOutput, ReplicatedWithGradAllReduce
from .latent_attention import LatentKeyValueProjection
from .linear import ColWiseParallel, LocalColWiseEmbedding, RowWiseParallel, TiedBiasColWiseParallel
from .packed import ColWiseConv1D, PackedColWiseParallel, RowWiseConv1D
from .parameter import SplitParameter
from .sequence_parallel import (
    SequenceParallelBegin,
    SequenceParallelDisable,
    SequenceParallelEnable,
    SequenceParallelEnd,
)

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
    "SplitParameter",
    "TensorParallelExperts",
    "IdentityExpertParallel",
    "LatentKeyValueProjection",
    "TiedBiasColWiseParallel",
    "optional",
]
