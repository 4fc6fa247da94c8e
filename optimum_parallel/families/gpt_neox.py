"""GPT-NeoX (Pythia): the fused `query_key_value` is interleaved per head ([q_h | k_h | v_h] for each
head h), so a plain split in whole heads is already a valid local fused projection."""

from __future__ import annotations

from torch import nn

from optimum_parallel import ColWiseParallel, Parallelizer, ParallelMesh, RowWiseParallel, optional

from ._common import check_heads, prefix


class GPTNeoXParallelizer(Parallelizer):
    supports_sequence_parallel = False

    @classmethod
    def check(cls, model: nn.Module, mesh: ParallelMesh) -> None:
        check_heads(mesh.tp_size, ("num_attention_heads", model.config.num_attention_heads))

    @classmethod
    def plan(cls, model, mesh, parallelize_embeddings, sequence_parallel_enabled):
        heads = model.config.num_attention_heads
        base = prefix(model)
        layer = base + r"layers\.\d+\."
        plan = {
            layer + r"attention\.query_key_value": ColWiseParallel(units=heads),
            layer + r"attention\.dense": RowWiseParallel(units=heads),
            layer + r"mlp\.dense_h_to_4h": ColWiseParallel(),
            layer + r"mlp\.dense_4h_to_h": RowWiseParallel(),
        }
        if parallelize_embeddings:
            plan[base + "embed_in"] = RowWiseParallel()
            plan["(lm_head|embed_out)"] = optional(ColWiseParallel())
        return plan
