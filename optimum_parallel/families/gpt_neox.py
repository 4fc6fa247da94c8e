"""GPT-NeoX (Pythia): the fused `query_key_value` is interleaved per head ([q_h | k_h | v_h] for each
head h), so a plain split in whole heads is already a valid local fused projection."""

from __future__ import annotations

from optimum_parallel import ColWiseParallel, RowWiseParallel, optional

from ._common import HeadSplitParallelizer, layer_plan, prefix


class GPTNeoXParallelizer(HeadSplitParallelizer):
    @classmethod
    def plan(cls, model, mesh, parallelize_embeddings, sequence_parallel_enabled):
        base = prefix(model)
        plan = layer_plan(
            base + r"layers\.\d+\.",
            cls.num_heads(model),
            qkv=r"attention\.query_key_value",
            out=r"attention\.dense",
            mlp_in=r"mlp\.dense_h_to_4h",
            mlp_out=r"mlp\.dense_4h_to_h",
        )
        if parallelize_embeddings:
            plan[base + "embed_in"] = RowWiseParallel()
            plan["(lm_head|embed_out)"] = optional(ColWiseParallel())
        return plan
