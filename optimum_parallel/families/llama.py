"""Llama-style decoders (llama, mistral, qwen2): q/k/v and gate/up column-parallel, o/down
row-parallel, vocab-parallel embedding and LM head with a vocab-parallel loss."""

from __future__ import annotations

from torch import nn

from optimum_parallel import (
    LLAMA_ACTIVATIONS,
    Capabilities,
    ColWiseParallel,
    Parallelizer,
    ParallelMesh,
    RowWiseParallel,
    SequenceParallelBegin,
    SequenceParallelDisable,
    SequenceParallelEnable,
    SequenceParallelEnd,
    optional,
)

from ._common import check_heads


class LlamaParallelizer(Parallelizer):
    capabilities = Capabilities(
        sequence_parallel=True, pipeline_parallel=True, context_parallel=True, activations=LLAMA_ACTIVATIONS
    )

    @staticmethod
    def _heads(model: nn.Module) -> tuple[int, int]:
        config = model.config
        heads = config.num_attention_heads
        return heads, getattr(config, "num_key_value_heads", None) or heads

    @classmethod
    def check(cls, model: nn.Module, mesh: ParallelMesh) -> None:
        heads, kv_heads = cls._heads(model)
        check_heads(mesh.tp_size, ("num_attention_heads", heads), ("num_key_value_heads", kv_heads))

    @classmethod
    def plan(cls, model, mesh, parallelize_embeddings, sequence_parallel_enabled):
        heads, kv_heads = cls._heads(model)
        base = cls.base_model_prefix(model).replace(".", r"\.")
        layer = base + r"layers\.\d+\."
        plan = {
            layer + r"self_attn\.q_proj": ColWiseParallel(units=heads),
            layer + r"self_attn\.(k|v)_proj": ColWiseParallel(units=kv_heads),
            layer + r"self_attn\.o_proj": RowWiseParallel(units=heads),
            layer + r"mlp\.(gate|up)_proj": ColWiseParallel(),
            layer + r"mlp\.down_proj": RowWiseParallel(),
        }
        head = []
        if parallelize_embeddings:
            plan[base + "embed_tokens"] = RowWiseParallel()
            head.append(ColWiseParallel())
        if sequence_parallel_enabled:
            plan.update(cls.sequence_parallel_plan(base))
            head.append(SequenceParallelEnd())
        if head:
            plan["lm_head"] = optional(head)  # absent on the bare base model
        return plan

    @staticmethod
    def sequence_parallel_plan(base: str) -> dict:
        """Split the sequence from the first decoder layer on; norms run on the slices (the LM head gathers)."""
        layer = base + r"layers\.\d+\."
        return {
            base + r"layers\.0": SequenceParallelBegin(on="input"),
            layer + r"(input|post_attention)_layernorm": SequenceParallelEnable(),
            layer + r"(self_attn|mlp)": SequenceParallelDisable(),
            base + "norm": SequenceParallelEnable(),
        }
