"""Tensor-parallel building blocks on local tensors: region ops, parallel layers, vocab-parallel loss."""

from ..comm.autograd_collectives import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .spec import ShardLayout
from .vocab_parallel_loss import VocabParallelLMLoss, vocab_parallel_cross_entropy

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ShardLayout",
    "VocabParallelEmbedding",
    "VocabParallelLMLoss",
    "copy_to_tensor_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_parallel_region",
    "vocab_parallel_cross_entropy",
]
