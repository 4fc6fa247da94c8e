"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE): Llama-style attention, experts split over tp.

Every expert's intermediate dim is split over tp (`TensorParallelExperts`): each rank computes its
slice of every routed expert, one all-reduce per MoE block. The router (and Qwen2-MoE's
`shared_expert_gate`) stays replicated outside the tp region, so routing is identical on every rank
and its gradients need no extra reduction. Qwen2-MoE's shared expert is an ordinary column/row MLP.
"""

from __future__ import annotations

from optimum_parallel import Capabilities, ColWiseParallel, RowWiseParallel, optional
from optimum_parallel.styles import ReplicatedWithGradAllReduce, SequenceParallelDisable, TensorParallelExperts

from ._common import prefix
from .llama import LlamaParallelizer


class MoEParallelizer(LlamaParallelizer):
    # under sequence parallelism the MoE block is replicated work on the whole sequence (`SequenceParallelDisable`
    # without column/row layers inside: gather in, split out); the experts stay one tp region inside it
    # pp: tests/test_expert_parallel_pipeline.py; cp (with ep): tests/test_expert_parallel_cp.py
    capabilities = Capabilities(sequence_parallel=True, pipeline_parallel=True, context_parallel=True)

    @classmethod
    def plan(cls, model, mesh, parallelize_embeddings, sequence_parallel_enabled):
        plan = super().plan(model, mesh, parallelize_embeddings, sequence_parallel_enabled)
        mlp = prefix(model) + r"layers\.\d+\.mlp\."
        for key in [k for k in plan if k.startswith(mlp)]:  # dense MLPs exist only in some layers here
            plan[key] = optional(plan[key])
        plan[mlp + "experts"] = TensorParallelExperts()
        plan[mlp + r"shared_expert\.(gate|up)_proj"] = optional(ColWiseParallel())
        plan[mlp + r"shared_expert\.down_proj"] = optional(RowWiseParallel())
        return plan


class Qwen3MoEParallelizer(MoEParallelizer):
    """Qwen3-MoE: the MoE plan plus Qwen3's per-head q_norm / k_norm, replicated with their gradients summed over tp
    (each rank normalizes only its own heads)."""

    @classmethod
    def plan(cls, model, mesh, parallelize_embeddings, sequence_parallel_enabled):
        plan = super().plan(model, mesh, parallelize_embeddings, sequence_parallel_enabled)
        plan[prefix(model) + r"layers\.\d+\.self_attn\.(q|k)_norm"] = ReplicatedWithGradAllReduce()
        return plan


class Qwen2MoEParallelizer(MoEParallelizer):
    """Qwen2-MoE: its shared expert (column/row layers) sits in the same block as the routed experts. Under
    sequence parallelism the block is replicated work on the whole sequence (gather in, split out) and the shared
    expert plain tensor parallelism inside it, so its output adds to the routed experts' whole-sequence one."""

    @classmethod
    def sequence_parallel_plan(cls, base: str) -> dict:
        plan = super().sequence_parallel_plan(base)
        layer = base + r"layers\.\d+\."
        del plan[layer + r"(self_attn|mlp)"]
        plan[layer + "self_attn"] = SequenceParallelDisable()
        plan[layer + "mlp"] = SequenceParallelDisable(replicate=True)
        return plan
