"""GPT-Neo: separate q/k/v and out_proj, global and local (windowed) attention layers alike; the
attention reshapes with `self.num_heads`, which the engine makes local after the swap."""

from __future__ import annotations

from torch import nn

from optimum_parallel import ColWiseParallel, Parallelizer, ParallelMesh, RowWiseParallel, optional

from ._common import check_heads, prefix


class GPTNeoParallelizer(Parallelizer):
    supports_sequence_parallel = False

    @classmethod
    def check(cls, model: nn.Module, mesh: ParallelMesh) -> None:
        check_heads(mesh.tp_size, ("num_heads", model.config.num_heads))

    @classmethod
    def plan(cls, model, mesh, parallelize_embeddings, sequence_parallel_enabled):
        heads = model.config.num_heads
        base = prefix(model)
        layer = base + r"h\.\d+\."
        plan = {
            layer + r"attn\.attention\.(q|k|v)_proj": ColWiseParallel(units=heads),
            layer + r"attn\.attention\.out_proj": RowWiseParallel(units=heads),
            layer + r"mlp\.c_fc": ColWiseParallel(),
            layer + r"mlp\.c_proj": RowWiseParallel(),
        }
        if parallelize_embeddings:
            plan[base + "wte"] = RowWiseParallel()
            plan["lm_head"] = optional(ColWiseParallel())
        return plan
