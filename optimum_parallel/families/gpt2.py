"""GPT-2: `Conv1D` layers (weight [in, out]) and a fused `c_attn` (q|k|v, each part split by heads).

The attention splits c_attn's output with `self.split_size` and counts `self.num_heads`, both made
local after the swap. GPT2LMHeadModel has no `loss_type`; it uses the causal-LM loss, declared here so
the vocab-parallel loss is installed for its vocab-parallel head.
"""

from __future__ import annotations

from torch import nn

from optimum_parallel import ColWiseParallel, ParallelMesh, RowWiseParallel, optional
from optimum_parallel.styles import ColWiseConv1D, PackedColWiseParallel, RowWiseConv1D
from optimum_parallel.tensor_parallel.conv1d import ColumnParallelConv1D

from ._common import HeadSplitParallelizer, prefix


class GPT2Parallelizer(HeadSplitParallelizer):
    heads_attribute = "n_head"

    @classmethod
    def check(cls, model: nn.Module, mesh: ParallelMesh) -> None:
        super().check(model, mesh)
        if getattr(model.config, "add_cross_attention", False):
            raise ValueError("GPT-2 with add_cross_attention=True is not supported by tensor parallelism yet")

    @classmethod
    def plan(cls, model, mesh, parallelize_embeddings, sequence_parallel_enabled):
        heads = cls.num_heads(model)
        base = prefix(model)
        layer = base + r"h\.\d+\."
        plan = {
            layer + r"attn\.c_attn": PackedColWiseParallel(3, units=heads),
            layer + r"attn\.c_proj": RowWiseConv1D(units=heads),
            layer + r"mlp\.c_fc": ColWiseConv1D(),
            layer + r"mlp\.c_proj": RowWiseConv1D(),
        }
        if parallelize_embeddings:
            plan[base + "wte"] = RowWiseParallel()
            causal = type(model).__name__ == "GPT2LMHeadModel"  # GPT2DoubleHeadsModel computes its own loss
            plan["lm_head"] = optional(ColWiseParallel(gather_output=not causal))
            if causal and getattr(model, "loss_type", None) is None:
                model.loss_type = "ForCausalLM"
        return plan

    @classmethod
    def after_plan(cls, model, mesh):
        for module in model.modules():
            c_attn = getattr(module, "c_attn", None)
            if isinstance(c_attn, ColumnParallelConv1D):
                module.split_size = c_attn.nf // 3
                module.num_heads = module.split_size // module.head_dim
