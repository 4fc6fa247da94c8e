"""Qwen3 and Gemma3 (text): Llama-style decoders with per-head q_norm/k_norm.

The norms' weights are shared by all heads but each rank only normalizes its own heads, so they stay
replicated and their gradients are summed over tp.
"""

from __future__ import annotations

from optimum_parallel import LLAMA_ACTIVATIONS, Capabilities
from optimum_parallel.styles import ReplicatedWithGradAllReduce

from ._common import prefix, with_structural_sequence_parallel
from .llama import LlamaParallelizer


class Qwen3Parallelizer(LlamaParallelizer):
    # the norms act inside self_attn, which sees the whole sequence
    capabilities = Capabilities(
        sequence_parallel=True, pipeline_parallel=True, context_parallel=True, activations=LLAMA_ACTIVATIONS
    )

    @classmethod
    def plan(cls, model, mesh, parallelize_embeddings, sequence_parallel_enabled):
        plan = super().plan(model, mesh, parallelize_embeddings, sequence_parallel_enabled)
        plan[prefix(model) + r"layers\.\d+\.self_attn\.(q|k)_norm"] = ReplicatedWithGradAllReduce()
        return plan


class Gemma3TextParallelizer(Qwen3Parallelizer):
    """Gemma 3 adds pre/post feed-forward norms the Llama sequence-parallel plan does not mark: its sequence
    parallelism is the one derived from its structure (every norm on the slices)."""

    capabilities = Capabilities(sequence_parallel=True, pipeline_parallel=True, context_parallel=True)

    @classmethod
    def plan(cls, model, mesh, parallelize_embeddings, sequence_parallel_enabled):
        plan = super().plan(model, mesh, parallelize_embeddings, False)
        return with_structural_sequence_parallel(model, plan) if sequence_parallel_enabled else plan
