"""GPT-OSS: the MoE plan with biases everywhere and one learnable attention sink per head.

q/k/v (with their biases) are split in whole heads as in Llama, and so is `sinks` (one logit per query head that
joins each head's softmax): each rank keeps its own heads' sinks. The experts carry biases: `gate_up_proj_bias` is
split like `gate_up_proj` (whole interleaved gate/up pairs), `down_proj_bias` stays whole and is added once
(`TensorParallelExperts`). Sliding-window layers need nothing: the mask is built on the whole sequence. Under cp the
sinks join each head's softmax once the ring has merged its chunk pairs.
"""

from __future__ import annotations

from optimum_parallel import Capabilities
from optimum_parallel.styles import SplitParameter

from ._common import prefix
from .moe import MoEParallelizer


class GptOssParallelizer(MoEParallelizer):
    # cp: its attention sinks join each head's softmax after the chunk pairs are merged (context_parallel/blocks.py)
    capabilities = Capabilities(sequence_parallel=True, pipeline_parallel=True, context_parallel=True)

    @classmethod
    def plan(cls, model, mesh, parallelize_embeddings, sequence_parallel_enabled):
        plan = super().plan(model, mesh, parallelize_embeddings, sequence_parallel_enabled)
        heads, _ = cls._heads(model)
        plan[prefix(model) + r"layers\.\d+\.self_attn\.sinks"] = SplitParameter("sinks", units=heads)
        return plan
