"""T5 (encoder-decoder): self- and cross-attention q/k/v column-parallel by heads, o row-parallel, the
relative attention bias split by heads (each rank looks up its own heads' bias, no communication),
dense (or gated) feed-forward column/row, vocab-parallel shared embeddings.

The LM head's logits are gathered: T5ForConditionalGeneration computes its loss on full logits.
"""

from __future__ import annotations

from torch import nn

from optimum_parallel import ColWiseParallel, Parallelizer, ParallelMesh, RowWiseParallel, optional
from optimum_parallel.styles import LocalColWiseEmbedding
from optimum_parallel.tensor_parallel import ColumnParallelLinear

from ._common import check_heads, local_heads


class T5Parallelizer(Parallelizer):
    supports_sequence_parallel = False

    @classmethod
    def check(cls, model: nn.Module, mesh: ParallelMesh) -> None:
        check_heads(mesh.tp_size, ("num_heads", model.config.num_heads))

    @classmethod
    def plan(cls, model, mesh, parallelize_embeddings, sequence_parallel_enabled):
        heads = model.config.num_heads
        layer = r"(encoder|decoder)\.block\.\d+\.layer\.\d+\."
        attention = layer + r"(SelfAttention|EncDecAttention)\."
        plan = {
            attention + r"(q|k|v)": ColWiseParallel(units=heads),
            attention + "o": RowWiseParallel(units=heads),
            attention + "relative_attention_bias": optional(LocalColWiseEmbedding(units=heads)),
            layer + r"DenseReluDense\.wi(_0|_1)?": ColWiseParallel(),
            layer + r"DenseReluDense\.wo": RowWiseParallel(),
        }
        if parallelize_embeddings:
            plan["shared"] = RowWiseParallel()
            plan[r"(encoder|decoder)\.embed_tokens"] = RowWiseParallel()
            plan["lm_head"] = optional(ColWiseParallel(gather_output=True))
        return plan

    @classmethod
    def after_plan(cls, model, mesh):
        for module in model.modules():
            if isinstance(getattr(module, "q", None), ColumnParallelLinear):
                module.n_heads = local_heads(module.q, module.key_value_proj_dim)
                module.inner_dim = module.q.weight.shape[0]
