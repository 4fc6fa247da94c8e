"""BERT and RoBERTa encoders with their task heads (masked LM, sequence and token classification, ...).

Self- and cross-attention q/k/v column-parallel by heads, output dense row-parallel, the feed-forward
column/row; vocab-parallel word embeddings. The MLM decoder shares the embedding's vocab split and its
bias stays tied to the head's `bias`; its logits are gathered because these models compute their MLM
loss on full logits. Pooler and classifiers act on full hidden states and stay replicated.
"""

from __future__ import annotations

from torch import nn

from optimum_parallel import ColWiseParallel, Parallelizer, ParallelMesh, RowWiseParallel, optional
from optimum_parallel.styles import TiedBiasColWiseParallel
from optimum_parallel.tensor_parallel import ColumnParallelLinear

from ._common import check_heads, local_heads, prefix


class BertParallelizer(Parallelizer):
    supports_sequence_parallel = False

    @classmethod
    def check(cls, model: nn.Module, mesh: ParallelMesh) -> None:
        check_heads(mesh.tp_size, ("num_attention_heads", model.config.num_attention_heads))

    @classmethod
    def plan(cls, model, mesh, parallelize_embeddings, sequence_parallel_enabled):
        heads = model.config.num_attention_heads
        base = prefix(model)
        layer = base + r"encoder\.layer\.\d+\."
        attention = layer + r"(attention|crossattention)\."
        plan = {
            attention + r"self\.(query|key|value)": ColWiseParallel(units=heads),
            attention + r"output\.dense": RowWiseParallel(units=heads),
            layer + r"intermediate\.dense": ColWiseParallel(),
            layer + r"output\.dense": RowWiseParallel(),
        }
        if parallelize_embeddings:
            plan[base + r"embeddings\.word_embeddings"] = RowWiseParallel()
            plan[r"cls\.predictions|lm_head"] = optional(TiedBiasColWiseParallel("decoder", "bias"))
        return plan

    @classmethod
    def after_plan(cls, model, mesh):
        for module in model.modules():
            if isinstance(getattr(module, "query", None), ColumnParallelLinear):
                module.num_attention_heads = local_heads(module.query, module.attention_head_size)
                module.all_head_size = module.query.weight.shape[0]
