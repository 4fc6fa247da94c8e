"""Small helpers shared by the family parallelizers: head checks, name prefixes, per-rank config views, the
Megatron layer plan and the local head counts of attention modules after the swap."""

from __future__ import annotations

from torch import nn

from optimum_parallel import ColWiseParallel, Parallelizer, ParallelMesh, RowWiseParallel, SequenceParallelEnd, optional
from optimum_parallel.autoplan.sequence_plan import sequence_parallel_plan
from optimum_parallel.tensor_parallel import ColumnParallelLinear
from optimum_parallel.tensor_parallel.spec import check_attention_heads as check_heads

__all__ = [
    "DecoderParallelizer",
    "with_structural_sequence_parallel",
    "HeadSplitParallelizer",
    "LocalConfig",
    "check_heads",
    "layer_plan",
    "local_heads",
    "localize_attention",
    "prefix",
]


class HeadSplitParallelizer(Parallelizer):
    """A family whose attention splits by whole heads, all counted by one config attribute (`heads_attribute`;
    no separate kv heads): `check()` says whether tp divides them."""

    heads_attribute = "num_attention_heads"

    @classmethod
    def num_heads(cls, model: nn.Module) -> int:
        return getattr(model.config, cls.heads_attribute)

    @classmethod
    def check(cls, model: nn.Module, mesh: ParallelMesh) -> None:
        check_heads(mesh.tp_size, (cls.heads_attribute, cls.num_heads(model)))


class DecoderParallelizer(HeadSplitParallelizer):
    """A decoder whose plan is Megatron's layer (`layer_plan`) plus a vocab-parallel word embedding and LM head,
    given as data: the regexes below, the layer's and the embedding's after the base-model prefix and `decoder`."""

    decoder = ""  # between the base-model prefix and the layers and embedding (OPT's r"decoder\.")
    layer: str  # one decoder layer: r"h\.\d+\."
    qkv_proj: str
    out_proj: str
    mlp_in: str
    mlp_out: str
    embedding: str
    lm_head = "lm_head"  # absent on the bare base model

    @classmethod
    def plan(cls, model, mesh, parallelize_embeddings, sequence_parallel_enabled):
        base = prefix(model) + cls.decoder
        heads = cls.num_heads(model)
        plan = layer_plan(base + cls.layer, heads, cls.qkv_proj, cls.out_proj, cls.mlp_in, cls.mlp_out)
        if parallelize_embeddings:
            plan[base + cls.embedding] = RowWiseParallel()
            plan[cls.lm_head] = optional(ColWiseParallel())
        return plan


def layer_plan(layer: str, heads: int, qkv: str, out: str, mlp_in: str, mlp_out: str) -> dict:
    """Megatron's layer: the q/k/v projection(s) `qkv` column-parallel and the attention output `out` row-parallel,
    both by whole heads; the MLP's input projection(s) `mlp_in` column- and its output `mlp_out` row-parallel.
    Every key is a regex appended to `layer`."""
    return {
        layer + qkv: ColWiseParallel(units=heads),
        layer + out: RowWiseParallel(units=heads),
        layer + mlp_in: ColWiseParallel(),
        layer + mlp_out: RowWiseParallel(),
    }


class LocalConfig:
    """A view of a shared model config with a few attributes replaced for this rank's module.

    Some attention modules read head counts from `self.config` at run time (Phi-3's fused qkv split);
    the shared config must keep the global values, so the module gets this view instead. Everything
    not overridden (e.g. `_attn_implementation`) is read from, and written to, the real config.
    """

    def __init__(self, config, **overrides) -> None:
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_overrides", overrides)

    def __getattr__(self, name: str):
        if name in ("_config", "_overrides") or name.startswith("__"):
            raise AttributeError(name)
        if name in self._overrides:
            return self._overrides[name]
        return getattr(self._config, name)

    def __setattr__(self, name: str, value) -> None:
        if name in self._overrides:
            self._overrides[name] = value
        else:
            setattr(self._config, name, value)

    def __repr__(self) -> str:
        return f"LocalConfig({type(self._config).__name__}, {self._overrides})"


def prefix(model: nn.Module) -> str:
    """Regex of the base-model prefix ('model\\.' for LlamaForCausalLM, '' for the bare base model)."""
    return Parallelizer.base_model_prefix(model).replace(".", r"\.")


def local_heads(projection: nn.Module, head_dim: int, dim: int = 0) -> int:
    """Heads held by this rank's split projection (its local output features / head_dim)."""
    return projection.weight.shape[dim] // head_dim


def localize_attention(model: nn.Module, projection: str, heads: str, head_dim: str, width: str) -> None:
    """After the swap, every attention module whose `projection` (its query) is column-parallel counts this rank's
    heads in its attribute `heads` and their width in `width`, which its forward reshapes with; `head_dim` names
    its attribute holding the size of one head."""
    for module in model.modules():
        query = getattr(module, projection, None)
        if isinstance(query, ColumnParallelLinear):
            setattr(module, heads, local_heads(query, getattr(module, head_dim)))
            setattr(module, width, query.weight.shape[0])


def with_structural_sequence_parallel(model: nn.Module, plan: dict) -> dict:
    """`plan` (a family's tensor-parallel plan) with the sequence-parallel entries derived from `model`'s structure
    (every norm of a layer on the slices, every block on the whole sequence: `autoplan/sequence_plan.py`) and the LM
    head gathering the sequence: for families whose layers carry more norms than Llama's (Gemma 2/3's pre/post
    feed-forward norms)."""
    plan = {**plan, **sequence_parallel_plan(model, plan)}
    head = plan.get("lm_head")
    styles = head.styles if isinstance(head, optional) else head
    styles = [] if styles is None else styles if isinstance(styles, list) else [styles]
    plan["lm_head"] = optional([*styles, SequenceParallelEnd()])
    return plan
