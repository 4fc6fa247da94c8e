"""T5 (encoder-decoder): self- and cross-attention q/k/v column-parallel by heads, o row-parallel, the
relative attention bias split by heads (each rank looks up its own heads' bias, no communication),
dense (or gated) feed-forward column/row, vocab-parallel shared embeddings.

The LM head's logits are gathered: T5ForConditionalGeneration computes its loss on full logits.
"""

from __future__ import annotations

from optimum_parallel import ColWiseParallel, RowWiseParallel, optional
from optimum_parallel.styles import LocalColWiseEmbedding

from ._common import HeadSplitParallelizer, layer_plan, localize_attention


class T5Parallelizer(HeadSplitParallelizer):
    heads_attribute = "num_heads"

    @classmethod
    def plan(cls, model, mesh, parallelize_embeddings, sequence_parallel_enabled):
        heads = cls.num_heads(model)
        layer = r"(encoder|decoder)\.block\.\d+\.layer\.\d+\."
        attention = r"(SelfAttention|EncDecAttention)\."
        plan = layer_plan(
            layer,
            heads,
            qkv=attention + r"(q|k|v)",
            out=attention + "o",
            mlp_in=r"DenseReluDense\.wi(_0|_1)?",
            mlp_out=r"DenseReluDense\.wo",
        )
        plan[layer + attention + "relative_attention_bias"] = optional(LocalColWiseEmbedding(units=heads))
        if parallelize_embeddings:
            plan["shared"] = RowWiseParallel()
            plan[r"(encoder|decoder)\.embed_tokens"] = RowWiseParallel()
            plan["lm_head"] = optional(ColWiseParallel(gather_output=True))
        return plan

    @classmethod
    def after_plan(cls, model, mesh):
        localize_attention(model, "q", "n_heads", "key_value_proj_dim", "inner_dim")
