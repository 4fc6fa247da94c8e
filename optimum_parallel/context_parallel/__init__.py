"""Context parallelism: the sequence split over cp ranks, attention over the whole of it (ring or all-to-all).

`apply_context_parallel(model, group)` makes a Hugging Face decoder context-parallel in place; the engine calls it
for a mesh with cp > 1. Modules: load_balance (which tokens a rank holds), blocks (attention between two chunks),
ring / ulysses (the two strategies), attention (the function transformers calls), loss, classifier (a sequence
classifier's pooled token), model (the input split).
"""

from .attention import STRATEGIES, check_strategy, sequence_mask
from .classifier import classifier_head, pooled_positions
from .load_balance import ChunkLayout
from .model import (
    apply_context_parallel,
    check_context_parallel,
    check_gradients_reduced,
    mark_gradients_reduced,
    pipeline_functions,
    split_batch,
)

__all__ = [
    "STRATEGIES",
    "ChunkLayout",
    "apply_context_parallel",
    "check_context_parallel",
    "check_gradients_reduced",
    "check_strategy",
    "classifier_head",
    "mark_gradients_reduced",
    "pipeline_functions",
    "pooled_positions",
    "sequence_mask",
    "split_batch",
]
