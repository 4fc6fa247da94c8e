"""OPT: separate q/k/v (with biases) and out_proj, fc1/fc2; learned positions stay replicated. The
attention reshapes with `self.num_heads`, which the engine makes local after the swap."""

from __future__ import annotations

from optimum_parallel import ColWiseParallel, RowWiseParallel, optional

from ._common import HeadSplitParallelizer, layer_plan, prefix


class OPTParallelizer(HeadSplitParallelizer):
    @classmethod
    def plan(cls, model, mesh, parallelize_embeddings, sequence_parallel_enabled):
        base = prefix(model) + r"decoder\."
        plan = layer_plan(
            base + r"layers\.\d+\.",
            cls.num_heads(model),
            qkv=r"self_attn\.(q|k|v)_proj",
            out=r"self_attn\.out_proj",
            mlp_in="fc1",
            mlp_out="fc2",
        )
        if parallelize_embeddings:
            plan[base + "embed_tokens"] = RowWiseParallel()
            plan["lm_head"] = optional(ColWiseParallel())
        return plan
