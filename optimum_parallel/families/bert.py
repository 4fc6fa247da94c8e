"""BERT and RoBERTa encoders with their task heads (masked LM, sequence and token classification, ...).

Self- and cross-attention q/k/v column-parallel by heads, output dense row-parallel, the feed-forward
column/row; vocab-parallel word embeddings. The MLM decoder shares the embedding's vocab split and its
bias stays tied to the head's `bias`; its logits are gathered because these models compute their MLM
loss on full logits. Pooler and classifiers act on full hidden states and stay replicated.
"""

from __future__ import annotations

from optimum_parallel import RowWiseParallel, optional
from optimum_parallel.styles import TiedBiasColWiseParallel

from ._common import HeadSplitParallelizer, layer_plan, localize_attention, prefix


class BertParallelizer(HeadSplitParallelizer):
    @classmethod
    def plan(cls, model, mesh, parallelize_embeddings, sequence_parallel_enabled):
        base = prefix(model)
        layer = base + r"encoder\.layer\.\d+\."
        attention = r"(attention|crossattention)\."
        plan = layer_plan(
            layer,
            cls.num_heads(model),
            qkv=attention + r"self\.(query|key|value)",
            out=attention + r"output\.dense",
            mlp_in=r"intermediate\.dense",
            mlp_out=r"output\.dense",
        )
        if parallelize_embeddings:
            plan[base + r"embeddings\.word_embeddings"] = RowWiseParallel()
            plan[r"cls\.predictions|lm_head"] = optional(TiedBiasColWiseParallel("decoder", "bias"))
        return plan

    @classmethod
    def after_plan(cls, model, mesh):
        localize_attention(model, "query", "num_attention_heads", "attention_head_size", "all_head_size")
