"""Automatic plans: a Parallelizer built from transformers' `base_model_tp_plan` for model types that have no
hand-written one, its style names translated to this engine's styles (a plan with any other style: the model type is
reported unsupported). What such a model supports beyond tp is derived from its structure (`autoplan/structure.py`),
its sequence parallelism planned from it (`autoplan/sequence_plan.py`). Details: docs/module_notes.md,
"frontends/auto_plan.py".
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from functools import cache

from torch import nn

from ..autoplan.capabilities import Capabilities
from ..autoplan.mixer_plan import check_mixers, merge_mixer_plan, mixers_left_whole
from ..autoplan.sequence_plan import sequence_parallel_plan
from ..autoplan.split_activations import split_activation_entries
from ..autoplan.structure import derive_capabilities
from ..mesh import ParallelMesh
from ..styles import (
    ColWiseParallel,
    IdentityExpertParallel,
    LatentKeyValueProjection,
    PackedColWiseParallel,
    ParallelStyle,
    ReplicatedWithGradAllReduce,
    RowWiseParallel,
    SequenceParallelEnd,
    TensorParallelExperts,
    optional,
)
from ..tensor_parallel.spec import check_attention_heads
from .parallelizer import Parallelizer

MODULE_STYLES = {
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "colwise_rep",
    "rowwise_split_input",
    "rowwise_rep",
    "packed_colwise",
    "replicated_with_grad_allreduce",
    "embedding_rowwise",
    "moe_tp_experts",
    "replicate",
    "mla_kv_a_proj",
}
# The expert tensors' styles, named by transformers after the dim they cut: [E, out, in] tensors (packed_colwise
# gate|up, rowwise down) or their [E, in, out] transposes (Llama 4's packed_rowwise gate|up, colwise down: colwise
# is read so only beside packed_rowwise; elsewhere (nemotron_h's up_proj, inkling2's gate_up_proj) it is untranslated)
EXPERT_PARAM_STYLES = {"packed_colwise": "packed", "packed_rowwise": "packed", "rowwise": "row"}
TRANSPOSED_EXPERT_PARAM_STYLES = {"packed_rowwise": "packed", "colwise": "row"}
EXPERT_MODULE_STYLES = {"moe_identity_expert"}  # children of an experts module: LongCat-Flash's identity experts
CAUSAL_LOSS_TYPES = ("ForCausalLM",)
# Plans that translate but give a wrong model here (found by running each automatic type at tp=2
# against transformers): the model type is reported unsupported instead.
KNOWN_BAD_PLANS = {
    # dt_proj mixes every kv head's values into each head's mask gate: under the plan's rowwise each rank computes every
    # head's gate but attends its own heads only; it needs the values gathered, then dt_proj and A split by heads
    "doge": "its attention's dt_proj and A (the dynamic mask's per-head gates) are not split with its heads",
}


def _config_class(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]
    except (KeyError, ValueError, ImportError):
        return None


def tp_plan_of(model_type_or_config) -> dict[str, str] | None:
    """The `base_model_tp_plan` of a model type (its config class) or of a config instance."""
    if isinstance(model_type_or_config, str):
        config = _config_class(model_type_or_config)
    else:
        config = getattr(model_type_or_config, "config", model_type_or_config)
    plan = getattr(config, "base_model_tp_plan", None) if config is not None else None
    return dict(plan) if plan else None


def _experts_keys(tp_plan: Mapping[str, str]) -> set[str]:
    return {key for key, style in tp_plan.items() if style == "moe_tp_experts"}


def _expert_param_styles(tp_plan: Mapping[str, str], experts_key: str) -> tuple[dict[str, str], bool]:
    """{transformers style: packed / row} the tensors under `experts_key` may use, and whether they are transposed
    (a packed_rowwise gate|up: Llama 4's [E, in, out] layout)."""
    transposed = any(k.startswith(experts_key + ".") and s == "packed_rowwise" for k, s in tp_plan.items())
    return (TRANSPOSED_EXPERT_PARAM_STYLES if transposed else EXPERT_PARAM_STYLES), transposed


def unsupported_entries(tp_plan: Mapping[str, str]) -> dict[str, str]:
    """The plan entries this engine cannot translate ({} when the whole plan is supported)."""
    experts = _experts_keys(tp_plan)
    bad = {}
    for key, style in tp_plan.items():
        parent = key.rpartition(".")[0]
        if parent in experts:
            if style not in _expert_param_styles(tp_plan, parent)[0] and style not in EXPERT_MODULE_STYLES:
                bad[key] = style
        elif style not in MODULE_STYLES:
            bad[key] = style
    return bad


def _key_regex(prefix: str, key: str) -> str:
    return prefix + r"\.".join(r"\d+" if part == "*" else re.escape(part) for part in key.split("."))


def _heads_of(model: nn.Module, regex: str, dim: int) -> int | None:
    """Whole heads of the first module `regex` names when it sits in an attention block (parent has head_dim), or
    in a latent attention block (parent has kv_lora_rank: its q_b / kv_b / o projections hold num_heads heads)."""
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if isinstance(module, nn.Linear) and re.fullmatch(regex, name):
            parent = modules.get(name.rpartition(".")[0])
            head_dim = getattr(parent, "head_dim", None)
            features = module.weight.shape[dim]
            heads = getattr(parent, "num_heads", None)
            if isinstance(getattr(parent, "kv_lora_rank", None), int) and isinstance(heads, int):
                return heads if heads > 0 and features % heads == 0 else None
            if isinstance(head_dim, int) and head_dim > 0 and features % head_dim == 0:
                return features // head_dim
            return None
    return None


def _rope_dim(model: nn.Module) -> int:
    """The shared rope key's width at the end of an MLA kv_a projection's output (the config's qk_rope_head_dim)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    rope_dim = getattr(config, "qk_rope_head_dim", None)
    if not isinstance(rope_dim, int):
        raise ValueError(f"{type(model).__name__}: an mla_kv_a_proj plan entry needs the config's qk_rope_head_dim")
    return rope_dim


def translate_tp_plan(model: nn.Module, tp_plan: Mapping[str, str], prefix: str) -> dict[str, object]:
    """This engine's plan for `model` from a transformers tp plan whose keys are relative to `prefix`."""
    bad = unsupported_entries(tp_plan)
    if bad:
        raise ValueError(f"base_model_tp_plan entries without a translation: {bad}")
    experts = _experts_keys(tp_plan)
    plan: dict[str, object] = {}
    for key, style in tp_plan.items():
        parent = key.rpartition(".")[0]
        regex = _key_regex(prefix, key)
        translated: ParallelStyle
        if style == "moe_identity_expert":  # passes its tokens whole inside the experts' tp region
            plan[regex] = optional(IdentityExpertParallel())
            continue
        if parent in experts or style == "replicate":
            continue
        if style == "mla_kv_a_proj":  # not split: its rope key's gradient summed over the heads' ranks
            translated = LatentKeyValueProjection(_rope_dim(model))
        elif style == "colwise":
            translated = ColWiseParallel(units=_heads_of(model, regex, 0))
        elif style == "rowwise":
            translated = RowWiseParallel(units=_heads_of(model, regex, 1))
        elif style in ("colwise_gather_output", "colwise_rep"):
            translated = ColWiseParallel(gather_output=True)
        elif style in ("rowwise_split_input", "rowwise_rep"):
            translated = RowWiseParallel(input_is_parallel=False)
        elif style == "packed_colwise":
            translated = PackedColWiseParallel(2)
        elif style == "replicated_with_grad_allreduce":
            translated = ReplicatedWithGradAllReduce()
        elif style == "embedding_rowwise":
            translated = RowWiseParallel()
        else:  # moe_tp_experts: the expert tensors named under this key, packed gate|up or row
            kinds, transposed = _expert_param_styles(tp_plan, key)
            params = {
                k.rpartition(".")[2]: kinds[s] for k, s in tp_plan.items() if k.startswith(key + ".") and s in kinds
            }
            translated = TensorParallelExperts(
                packed=[p for p, kind in params.items() if kind == "packed"],
                row=[p for p, kind in params.items() if kind == "row"],
                transposed=True if transposed else None,
            )
        plan[regex] = optional(translated)  # layer-type variants: not every key exists in every model
    plan.update(split_activation_entries(model, plan))
    return plan


def with_entries(plan: Mapping[str, object], entries: Mapping[str, object]) -> dict[str, object]:
    """`plan` with `entries` added; a key in both keeps both's styles (a mixer's own sizes and the sequence-parallel
    gather at its entry name the same module)."""
    merged = dict(plan)
    for key, value in entries.items():
        if key in merged:
            styles = [*_styles_of(merged[key]), *_styles_of(value)]
            merged[key] = optional(styles)
        else:
            merged[key] = value
    return merged


def _styles_of(value) -> list:
    styles = value.styles if isinstance(value, optional) else value
    return list(styles) if isinstance(styles, (list, tuple)) else [styles]


def _check_heads(config, tp: int) -> None:
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    if isinstance(heads, int):
        kv = ("num_key_value_heads", kv_heads) if isinstance(kv_heads, int) else None
        check_attention_heads(tp, ("num_attention_heads", heads), kv)


class AutoPlanParallelizer(Parallelizer):
    """A Parallelizer whose plan is translated from the model's `base_model_tp_plan` (see `auto_parallelizer`)."""

    model_type: str = ""

    @classmethod
    def capabilities_for(cls, model: nn.Module) -> Capabilities:
        """Derived from the model's structure, layer by layer (`autoplan/structure.py`)."""
        return derive_capabilities(model)

    @classmethod
    def check(cls, model: nn.Module, mesh: ParallelMesh) -> None:
        _check_heads(model.config, mesh.tp_size)
        check_mixers(model, mesh.tp_size)
        plan = tp_plan_of(model)
        if not plan:
            raise ValueError(f"{type(model).__name__}'s config carries no base_model_tp_plan to build a plan from")
        bad = unsupported_entries(plan)
        if bad:
            raise ValueError(f"{type(model).__name__}: base_model_tp_plan entries without a translation: {bad}")

    @classmethod
    def plan(cls, model, mesh, parallelize_embeddings, sequence_parallel_enabled):
        prefix = cls.base_model_prefix(model)
        plan = translate_tp_plan(model, tp_plan_of(model), prefix.replace(".", r"\."))
        plan = merge_mixer_plan(plan, model, mesh.tp_size)  # mixers and blocks the tp plan leaves whole, split
        if mesh.tp_size > 1:
            for name, why in mixers_left_whole(model, mesh.tp_size).items():
                warnings.warn(f"{name} is not split over tensor_parallel_size={mesh.tp_size}: {why}", stacklevel=2)
        base = model.get_submodule(prefix[:-1]) if prefix else model
        head = []
        if parallelize_embeddings:
            # Gemma 4's per-layer table (vocabulary x layers x width) is split by vocabulary as the token embedding
            for name in ("embed_tokens", "embed_tokens_per_layer"):
                if isinstance(getattr(base, name, None), nn.Embedding):
                    plan.setdefault(re.escape(prefix) + name, RowWiseParallel())
            if isinstance(getattr(model, "lm_head", None), nn.Linear):
                causal = getattr(model, "loss_type", None) in CAUSAL_LOSS_TYPES
                head.append(ColWiseParallel(gather_output=not causal))
        if sequence_parallel_enabled:
            plan = with_entries(plan, sequence_parallel_plan(model, plan))
            head.append(SequenceParallelEnd())
        if head:
            plan["lm_head"] = optional(head)  # absent on the bare base model
        return plan


@cache
def _auto_parallelizer_class(model_type: str) -> type[Parallelizer]:
    attributes = {"model_type": model_type}
    return type(f"AutoPlanParallelizer[{model_type}]", (AutoPlanParallelizer,), attributes)


def auto_parallelizer(model_type_or_config) -> type[Parallelizer] | None:
    """A Parallelizer built from the `base_model_tp_plan` of a model type / config / model, or None
    when there is no plan or it uses styles this engine cannot translate."""
    plan = tp_plan_of(model_type_or_config)
    if not plan or unsupported_entries(plan):
        return None
    if isinstance(model_type_or_config, str):
        model_type = model_type_or_config
    else:
        model_type = getattr(getattr(model_type_or_config, "config", model_type_or_config), "model_type", "")
    if model_type in KNOWN_BAD_PLANS:
        return None
    return _auto_parallelizer_class(model_type)


@cache
def auto_plan_model_types() -> tuple[str, ...]:
    """Every transformers model type whose `base_model_tp_plan` translates (imports each config class once)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return tuple(sorted(mt for mt in CONFIG_MAPPING.keys() if auto_parallelizer(mt) is not None))
