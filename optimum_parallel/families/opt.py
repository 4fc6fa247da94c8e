"""OPT: separate q/k/v (with biases) and out_proj, fc1/fc2; learned positions stay replicated. The
attention reshapes with `self.num_heads`, which the engine makes local after the swap."""

from __future__ import annotations

from torch import nn

from optimum_parallel import ColWiseParallel, Parallelizer, ParallelMesh, RowWiseParallel, optional

from ._common import check_heads, prefix


class OPTParallelizer(Parallelizer):
    supports_sequence_parallel = False

    @classmethod
    def check(cls, model: nn.Module, mesh: ParallelMesh) -> None:
        check_heads(mesh.tp_size, ("num_attention_heads", model.config.num_attention_heads))

    @classmethod
    def plan(cls, model, mesh, parallelize_embeddings, sequence_parallel_enabled):
        heads = model.config.num_attention_heads
        base = prefix(model) + r"decoder\."
        layer = base + r"layers\.\d+\."
        plan = {
            layer + r"self_attn\.(q|k|v)_proj": ColWiseParallel(units=heads),
            layer + r"self_attn\.out_proj": RowWiseParallel(units=heads),
            layer + "fc1": ColWiseParallel(),
            layer + "fc2": RowWiseParallel(),
        }
        if parallelize_embeddings:
            plan[base + "embed_tokens"] = RowWiseParallel()
            plan["lm_head"] = optional(ColWiseParallel())
        return plan
