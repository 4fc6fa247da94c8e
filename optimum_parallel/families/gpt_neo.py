"""GPT-Neo: separate q/k/v and out_proj, global and local (windowed) attention layers alike; the
attention reshapes with `self.num_heads`, which the engine makes local after the swap."""

from __future__ import annotations

from optimum_parallel import ColWiseParallel, RowWiseParallel, optional

from ._common import HeadSplitParallelizer, layer_plan, prefix


class GPTNeoParallelizer(HeadSplitParallelizer):
    heads_attribute = "num_heads"

    @classmethod
    def plan(cls, model, mesh, parallelize_embeddings, sequence_parallel_enabled):
        base = prefix(model)
        plan = layer_plan(
            base + r"h\.\d+\.",
            cls.num_heads(model),
            qkv=r"attn\.attention\.(q|k|v)_proj",
            out=r"attn\.attention\.out_proj",
            mlp_in=r"mlp\.c_fc",
            mlp_out=r"mlp\.c_proj",
        )
        if parallelize_embeddings:
            plan[base + "wte"] = RowWiseParallel()
            plan["lm_head"] = optional(ColWiseParallel())
        return plan
