"""Phi-3: fused `qkv_proj` and `gate_up_proj`, each part split on its own (never the fused block).

Rank r holds [q heads of r | its kv heads | its kv heads] and [gate_r | up_r]. Phi-3's attention reads
the query width from `self.config`, so each attention module gets a per-rank view of the config.
"""

from __future__ import annotations

from torch import nn

from optimum_parallel import Capabilities, ColWiseParallel, Parallelizer, ParallelMesh, RowWiseParallel, optional
from optimum_parallel.styles import PackedColWiseParallel
from optimum_parallel.tensor_parallel import ColumnParallelLinear

from ._common import LocalConfig, check_heads, local_heads, prefix, with_structural_sequence_parallel


class Phi3Parallelizer(Parallelizer):
    capabilities = Capabilities(sequence_parallel=True, pipeline_parallel=True, context_parallel=True)

    @staticmethod
    def _heads(model: nn.Module) -> tuple[int, int, int]:
        config = model.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return heads, getattr(config, "num_key_value_heads", None) or heads, head_dim

    @classmethod
    def check(cls, model: nn.Module, mesh: ParallelMesh) -> None:
        heads, kv_heads, _ = cls._heads(model)
        check_heads(mesh.tp_size, ("num_attention_heads", heads), ("num_key_value_heads", kv_heads))

    @classmethod
    def plan(cls, model, mesh, parallelize_embeddings, sequence_parallel_enabled):
        heads, kv_heads, head_dim = cls._heads(model)
        base = prefix(model)
        layer = base + r"layers\.\d+\."
        qkv_sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        plan = {
            layer + r"self_attn\.qkv_proj": PackedColWiseParallel(qkv_sizes, units=[heads, kv_heads, kv_heads]),
            layer + r"self_attn\.o_proj": RowWiseParallel(units=heads),
            layer + r"mlp\.gate_up_proj": PackedColWiseParallel(2),
            layer + r"mlp\.down_proj": RowWiseParallel(),
        }
        if parallelize_embeddings:
            plan[base + "embed_tokens"] = RowWiseParallel()
            plan["lm_head"] = optional(ColWiseParallel())
        return with_structural_sequence_parallel(model, plan) if sequence_parallel_enabled else plan

    @classmethod
    def after_plan(cls, model, mesh):
        heads, kv_heads, head_dim = cls._heads(model)
        for module in model.modules():
            qkv = getattr(module, "qkv_proj", None)
            if isinstance(qkv, ColumnParallelLinear):
                local_q, local_kv = heads // mesh.tp_size, max(kv_heads // mesh.tp_size, 1)
                assert local_heads(qkv, head_dim) == local_q + 2 * local_kv
                module.config = LocalConfig(module.config, num_attention_heads=local_q, num_key_value_heads=local_kv)
                module.num_key_value_heads = local_kv
                module.num_key_value_groups = local_q // local_kv
