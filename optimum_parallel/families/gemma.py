"""Gemma and Gemma 2: Llama-style decoders; nothing beyond the Llama plan is needed for tensor parallelism.

The scaled word embedding keeps its `embed_scale` in the vocab-parallel embedding, the tied LM head
shares the embedding's vocab split, attention soft-capping acts per head on local heads and the final
logit soft-capping is element-wise on the vocab-parallel logits (the loss sees the capped logits).
"""

from __future__ import annotations

from optimum_parallel import Capabilities

from ._common import with_structural_sequence_parallel
from .llama import LlamaParallelizer


class GemmaParallelizer(LlamaParallelizer):
    # the Llama sequence-parallel plan fits Gemma's layer layout; its activations are not the planner's Llama count;
    # its attention is Llama's: context parallelism as the family matrix runs it
    capabilities = Capabilities(sequence_parallel=True, pipeline_parallel=True, context_parallel=True)


class Gemma2Parallelizer(GemmaParallelizer):
    """Gemma 2 adds pre/post feed-forward norms the Llama sequence-parallel plan does not mark: its sequence
    parallelism is the one derived from its structure (every norm on the slices); its attention, soft-capping
    included, runs under context parallelism (tests/test_context_parallel.py)."""

    capabilities = Capabilities(sequence_parallel=True, pipeline_parallel=True, context_parallel=True)

    @classmethod
    def plan(cls, model, mesh, parallelize_embeddings, sequence_parallel_enabled):
        plan = super().plan(model, mesh, parallelize_embeddings, False)
        return with_structural_sequence_parallel(model, plan) if sequence_parallel_enabled else plan
