"""Vision-language models (llava, gemma3, qwen2_5_vl, qwen3_vl, ...): a Parallelizer for a composite image-text model,
derived from its structure: the language model gets its text model type's plan, re-rooted at its prefix; the vision
tower's attention blocks and two-layer MLPs are split where tp divides them, the rest replicated (`vision_report`
says which). What runs beyond tp: docs/module_notes.md, "frontends/multimodal.py".
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import replace
from functools import cache

from torch import nn

from ..autoplan.capabilities import Capabilities
from ..autoplan.sequence_plan import sequence_parallel_plan
from ..autoplan.structure import context_parallel_layer_blocker, derive_capabilities
from ..comm.autograd_collectives import copy_to_tensor_parallel_region
from ..comm.tp_entry import SequenceRegion
from ..context_parallel.load_balance import pad_sequence
from ..mesh import ParallelMesh, ranks
from ..state import parallel_state
from ..styles import (
    ColWiseParallel,
    PackedColWiseParallel,
    ReplicatedWithGradAllReduce,
    RowWiseParallel,
    SequenceParallelEnd,
    optional,
)
from ..styles.base import ParallelStyle, PlanContext
from ..tensor_parallel import ColumnParallelLinear
from ..tensor_parallel.spec import check_attention_heads
from .auto_plan import AutoPlanParallelizer, auto_parallelizer, tp_plan_of
from .parallelizer import Parallelizer

VISION_NAMES = ("vision_tower", "visual", "vision_model")
PROJECTOR_NAMES = ("multi_modal_projector", "mm_projector")  # Qwen's projector is inside its vision tower (merger)
QUERY_KEY_VALUE = ("q_proj", "k_proj", "v_proj")
ATTENTION_OUT = ("o_proj", "out_proj", "proj")
# (inputs, output) Linear children of a two-layer MLP, by name
MLP_PAIRS = (
    (("fc1",), "fc2"),
    (("linear_fc1",), "linear_fc2"),
    (("linear_1",), "linear_2"),
    (("gate_proj", "up_proj"), "down_proj"),
    (("0",), "2"),  # nn.Sequential(Linear, activation, Linear)
)


class MultimodalParts:
    """Where the parts of a composite image-text model sit: the language model's prefix ('model.language_model.'),
    the vision tower's and the projector's (None when absent)."""

    def __init__(self, model: nn.Module) -> None:
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        names = {id(module): name for name, module in model.named_modules()}
        if not isinstance(decoder, nn.Module) or id(decoder) not in names or decoder is model:
            raise ValueError(f"{type(model).__name__} has no language model (get_decoder()) to parallelize")
        self.language_model: nn.Module = decoder
        self.language_prefix = names[id(decoder)] + "."
        self.vision_prefix = self._find(model, VISION_NAMES)
        self.projector_prefix = self._find(model, PROJECTOR_NAMES)

    @staticmethod
    def _find(model: nn.Module, attributes: tuple[str, ...]) -> str | None:
        for name, module in model.named_modules():
            if name.rpartition(".")[2] in attributes and isinstance(module, nn.Module):
                return name + "."
        return None

    def outside_language_model(self, name: str) -> bool:
        return not name.startswith(self.language_prefix) and name != self.language_prefix[:-1]


def _linear(module: nn.Module | None) -> nn.Linear | None:
    return module if isinstance(module, nn.Linear) else None


def _heads(module: nn.Module) -> int | None:
    """The query heads of an attention module (its `head_dim` and q/k/v or packed qkv Linear children)."""
    head_dim = getattr(module, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim <= 0:
        return None
    query = _linear(getattr(module, "q_proj", None))
    if query is not None and query.out_features % head_dim == 0:
        return query.out_features // head_dim
    packed = _linear(getattr(module, "qkv", None))
    if packed is not None and packed.out_features % (3 * head_dim) == 0:
        return packed.out_features // (3 * head_dim)
    return None


def attention_styles(name: str, module: nn.Module, tp: int) -> tuple[dict[str, object], str]:
    """The plan of one attention module `name` (regex keys) and what happens to it, in words."""
    heads, head_dim = _heads(module), getattr(module, "head_dim", 0)
    if heads is None:
        return {}, "replicated (no q/k/v or qkv projections with whole heads)"
    out = next((child for child in ATTENTION_OUT if _linear(getattr(module, child, None)) is not None), None)
    if heads % tp or out is None:
        why = f"{heads} heads do not divide by tp={tp}" if heads % tp else "no output projection found"
        return {}, f"replicated ({why})"
    base = re.escape(name) + r"\."
    plan: dict[str, object] = {base + re.escape(out): RowWiseParallel(units=heads)}
    if _linear(getattr(module, "q_proj", None)) is not None:
        for child in QUERY_KEY_VALUE:
            linear = _linear(getattr(module, child, None))
            if linear is not None:
                plan[base + child] = ColWiseParallel(units=linear.out_features // head_dim)
    else:
        plan[base + "qkv"] = PackedColWiseParallel(3, units=heads)
    for child_name, child in module.named_children():  # per-head norms act on this rank's heads only
        weight = getattr(child, "weight", None)
        if not isinstance(child, nn.Linear) and weight is not None and tuple(weight.shape) == (head_dim,):
            plan[base + re.escape(child_name)] = ReplicatedWithGradAllReduce()
    return plan, f"split: {heads} heads, {heads // tp} per rank"


def mlp_styles(name: str, module: nn.Module, tp: int) -> tuple[dict[str, object], str] | None:
    """The plan of a two-layer MLP `name` (its inputs column-, its output row-parallel), or None if it is not one."""
    for inputs, output in MLP_PAIRS:
        ins = [_linear(getattr(module, child, None)) for child in inputs]
        out = _linear(getattr(module, output, None))
        if out is None or any(linear is None for linear in ins):
            continue
        if any(linear.out_features != out.in_features for linear in ins):
            continue
        if isinstance(module, nn.Sequential) and len(module) != 3:
            continue
        width = out.in_features
        if width % tp:
            return {}, f"replicated (hidden width {width} does not divide by tp={tp})"
        base = re.escape(name) + r"\."
        plan: dict[str, object] = {base + re.escape(child): ColWiseParallel() for child in inputs}
        plan[base + re.escape(output)] = RowWiseParallel()
        return plan, f"split: hidden width {width}, {width // tp} per rank"
    return None


def vision_plan(model: nn.Module, parts: MultimodalParts, tp: int) -> tuple[dict[str, object], dict[str, str]]:
    """The plan of everything outside the language model, and per attention block / MLP what happens to it."""
    plan: dict[str, object] = {}
    report: dict[str, str] = {}
    for name, module in model.named_modules():
        if not name or not parts.outside_language_model(name) or name.startswith(parts.language_prefix):
            continue
        if any(name.startswith(done + ".") for done in report):
            continue  # inside a block already planned
        if _heads(module) is not None:
            styles, what = attention_styles(name, module, tp)
        elif (found := mlp_styles(name, module, tp)) is not None:
            styles, what = found
        else:
            continue
        plan.update(styles)
        report[name] = what
    return plan, report


def vision_report(model: nn.Module, tp: int) -> dict[str, str]:
    """Per attention block and MLP outside the language model: split (how) or replicated (why)."""
    return vision_plan(model, MultimodalParts(model), tp)[1]


# ------------------------------------------------------------------------------------------------ the text plan


def structural_text_plan(language_model: nn.Module, tp: int) -> dict[str, object]:
    """The Megatron plan of a decoder derived from its layers (attention by whole heads, MLPs, vocab-parallel
    embedding), for a text model with neither a family nor an automatic plan that splits its layers."""
    plan: dict[str, object] = {}
    for name, module in language_model.named_modules():
        if _heads(module) is not None:
            plan.update(attention_styles(name, module, tp)[0])
        elif (found := mlp_styles(name, module, tp)) is not None:
            plan.update(found[0])
    if isinstance(getattr(language_model, "embed_tokens", None), nn.Embedding):
        plan["embed_tokens"] = RowWiseParallel()
    return plan


def check_sequence_parallel(parts: MultimodalParts, text_family: type[Parallelizer] | None) -> None:
    """Sequence parallelism splits the language model's hidden states from its first layer on: refused, naming the
    module, where its text family has no sequence-parallel plan or its decoder is not Llama-shaped. Image features
    added inside the layers (Qwen3-VL's deepstack) are split with the sequence (`SplitDeepstackFeatures`)."""
    language, name = parts.language_model, parts.language_prefix[:-1]
    automatic = text_family is None or issubclass(text_family, AutoPlanParallelizer)
    if not automatic and not text_family.capabilities.sequence_parallel:
        raise NotImplementedError(
            f"sequence_parallel_enabled=True: {name}'s family {text_family.__name__} has no sequence-parallel plan; "
            "allowed for this model: False"
        )
    why = derive_capabilities(language).reason("sequence") if automatic else None
    if why is not None:  # a structural or automatic text plan takes the sequence plan derived from the structure
        raise NotImplementedError(
            f"sequence_parallel_enabled=True: {name} ({type(language).__name__}): {why}; allowed for this model: False"
        )


def _cut_deepstack_features(model: nn.Module, language: nn.Module, args: tuple, kwargs: dict):
    """Under cp: Qwen3-VL's language model adds deepstack image features at `visual_pos_masks` (batch, seq) of the
    whole sequence; this rank keeps the mask of its chunks and those features, in its chunks' order (the layout the
    model's entry cut the labels with)."""
    mask, features = kwargs.get("visual_pos_masks"), kwargs.get("deepstack_visual_embeds")
    layout = parallel_state(model).sequence_layout
    if mask is None or features is None or layout is None:
        return None
    whole = pad_sequence(mask.bool(), layout.length, False)
    ordinal = (whole.reshape(-1).long().cumsum(0) - 1).reshape(whole.shape)  # each image token's feature row
    local = layout.take(whole)
    rows = layout.take(ordinal)[local]
    return args, {**kwargs, "visual_pos_masks": local, "deepstack_visual_embeds": [f[rows] for f in features]}


def adds_deepstack_features(language: nn.Module) -> bool:
    """Whether the language model adds image features to the hidden states of its first layers (Qwen3-VL's
    deepstack, at `visual_pos_masks`)."""
    return "deepstack_visual_embeds" in inspect.signature(type(language).forward).parameters


def _split_deepstack_features(region: SequenceRegion, group, module, args: tuple, kwargs: dict):
    """Under sp: the deepstack features this tp rank adds, at the positions of its slice of the sequence (the rule
    the region's entry applies: an unsplit forward keeps them whole). Every rank's vision tower computed all of them,
    and each uses its own: their gradient is summed over tp (`copy_to_tensor_parallel_region`)."""
    mask, features = kwargs.get("visual_pos_masks"), kwargs.get("deepstack_visual_embeds")
    if mask is None or features is None or not region.splits(mask.shape[1]):
        return None
    rank, tp = ranks.rank(group), ranks.world_size(group)
    width = mask.shape[1] // tp
    mask = mask.bool()
    ordinal = (mask.reshape(-1).long().cumsum(0) - 1).reshape(mask.shape)  # each image token's feature row
    local = mask[:, rank * width : (rank + 1) * width]
    rows = ordinal[:, rank * width : (rank + 1) * width][local]
    split = [copy_to_tensor_parallel_region(f, group)[rows] for f in features]
    return args, {**kwargs, "visual_pos_masks": local, "deepstack_visual_embeds": split}


class SplitDeepstackFeatures(ParallelStyle):
    """Sequence parallelism on a language model adding deepstack image features inside its layers (Qwen3-VL): each
    tp rank adds the features of its slice of the sequence (`_split_deepstack_features`)."""

    def apply(self, module: nn.Module, name: str, ctx: PlanContext) -> nn.Module:
        hook = functools.partial(_split_deepstack_features, ctx.sequence, ctx.mesh.tp_group)
        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def check_context_parallel_parts(model: nn.Module, parts: MultimodalParts, cp: int) -> None:
    """Context parallelism cuts the sequence at the language model's entry, after the image features are merged
    (`context_parallel.model.composite_decoder`), and builds the masks from the chunks' global positions. Gemma 3's
    image tokens attend to one another both ways (its `token_type_ids`: each run of image tokens is one block, as its
    modeling module's `get_block_sequence_ids_for_mask` reads them): the model's entry carries those blocks to the
    attention (`context_parallel.model.image_blocks`). Any other model reading `token_type_ids` is refused, naming the
    module. Image features added inside the layers (Qwen3-VL's deepstack) are cut with the sequence
    (`_cut_deepstack_features`)."""
    name = parts.language_prefix[:-1]
    owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    if "token_type_ids" not in inspect.signature(type(owner).forward).parameters:
        return
    modeling = inspect.getmodule(type(owner))
    image_blocks = callable(getattr(modeling, "get_block_sequence_ids_for_mask", None))
    if not image_blocks or "token_type_ids" not in inspect.signature(type(model).forward).parameters:
        raise NotImplementedError(
            f"{type(model).__name__} with cp={cp} is not supported: {type(owner).__name__} builds its attention mask "
            "from token_type_ids, and context parallelism's attention knows only Gemma 3's reading of them (each "
            "image's tokens attending to one another both ways); allowed for this model: cp=1"
        )


class MultimodalParallelizer(Parallelizer):
    """A composite image-text model: the text family's plan re-rooted at the language model, plus the vision tower's
    and projector's structural plan (docs/module_notes.md). `text_family` None: the structural text plan."""

    text_family: type[Parallelizer] | None = None
    model_type = ""

    @classmethod
    def capabilities_for(cls, model: nn.Module) -> Capabilities:
        """The declared capabilities, with context parallelism refused where the language model's layers refuse it:
        the same per-layer check as a text model's (`autoplan/structure.py`), naming the layer."""
        capabilities = cls.capabilities
        if not capabilities.context_parallel:
            return capabilities
        parts = MultimodalParts(model)
        why = context_parallel_layer_blocker(parts.language_model)
        if why is None:
            return capabilities
        prefix = parts.language_prefix
        return replace(capabilities, context_parallel=False, refusals=(("context", f"{prefix}{why}"),))

    @classmethod
    def check(cls, model: nn.Module, mesh: ParallelMesh) -> None:
        parts = MultimodalParts(model)
        if mesh.size("pp") > 1 and mesh.size("cp") > 1:
            raise NotImplementedError(
                f"{type(model).__name__} with pp={mesh.size('pp')} and cp={mesh.size('cp')} is not supported: the "
                "first pipeline stage merges the image features into the whole sequence, which context parallelism "
                "cuts at the language model's entry; allowed for vision-language models: pp=1 or cp=1"
            )
        if mesh.size("cp") > 1:
            check_context_parallel_parts(model, parts, mesh.size("cp"))
        if cls.text_family is not None:
            cls.text_family.check(parts.language_model, mesh)
        else:
            config = parts.language_model.config
            heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
            if isinstance(heads, int):
                check_attention_heads(
                    mesh.tp_size, ("num_attention_heads", heads), ("num_key_value_heads", kv) if kv else None
                )

    @classmethod
    def plan(cls, model, mesh, parallelize_embeddings, sequence_parallel_enabled):
        parts = MultimodalParts(model)
        language = parts.language_model
        if sequence_parallel_enabled:
            check_sequence_parallel(parts, cls.text_family)
        if cls.text_family is not None:
            text = dict(cls.text_family.plan(language, mesh, parallelize_embeddings, sequence_parallel_enabled))
        else:
            text = structural_text_plan(language, mesh.tp_size)
            if not parallelize_embeddings:
                text.pop("embed_tokens", None)
            if sequence_parallel_enabled:
                text.update(sequence_parallel_plan(language, text))
        head = text.pop("lm_head", None)
        if cls.text_family is None or issubclass(cls.text_family, AutoPlanParallelizer):
            head = None  # the language model alone has no LM head: its automatic plan left it whole
        prefix = re.escape(parts.language_prefix)
        plan: dict[str, object] = {prefix + f"(?:{key})": style for key, style in text.items()}
        if head is None:  # vocab-parallel (with the vocab-parallel loss), gathering the sequence under sp
            styles = [ColWiseParallel()] if parallelize_embeddings else []
            styles += [SequenceParallelEnd()] if sequence_parallel_enabled else []
            head = optional(styles) if styles else None
        if head is not None and isinstance(getattr(model, "lm_head", None), nn.Linear):
            plan["lm_head"] = head
        plan.update(vision_plan(model, parts, mesh.tp_size)[0])
        if sequence_parallel_enabled and adds_deepstack_features(language):
            plan[re.escape(parts.language_prefix[:-1])] = SplitDeepstackFeatures()
        return plan

    @classmethod
    def after_plan(cls, model: nn.Module, mesh: ParallelMesh) -> None:
        parts = MultimodalParts(model)
        if cls.text_family is not None:
            cls.text_family.after_plan(parts.language_model, mesh)
        language = parts.language_model
        if mesh.size("cp") > 1 and adds_deepstack_features(language):
            # before context parallelism's own cut and sequence parallelism's split of the features (applied earlier)
            hook = functools.partial(_cut_deepstack_features, model)
            language.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
        for module in model.modules():  # a packed qkv reshapes with the module's own head count
            packed = getattr(module, "qkv", None)
            head_dim = getattr(module, "head_dim", None)
            if isinstance(packed, ColumnParallelLinear) and isinstance(head_dim, int) and hasattr(module, "num_heads"):
                module.num_heads = packed.weight.shape[0] // (3 * head_dim)

    @classmethod
    def pipeline_split_spec(cls, model: nn.Module) -> str:
        return MultimodalParts(model).language_prefix + "layers"


def _text_family_of(text_config, registered) -> type[Parallelizer] | None:
    family = registered(getattr(text_config, "model_type", ""))
    if family is not None:
        return family
    automatic = auto_parallelizer(text_config)
    plan = tp_plan_of(text_config) or {}
    if automatic is not None and any(key.startswith("layers.") for key in plan):
        return automatic
    return None


@cache
def _multimodal_class(
    model_type: str, text_family: type[Parallelizer] | None, context_parallel: bool
) -> type[Parallelizer]:
    text = text_family.capabilities if text_family is not None else Capabilities()
    # sp and pp are refused by name in `plan` / `check` (when the family is used); cp is declared only where it runs,
    # so an explicit plan without the family refuses it too
    capabilities = Capabilities(True, True, context_parallel, activations=text.activations)
    attributes = {"model_type": model_type, "text_family": text_family, "capabilities": capabilities}
    return type(f"MultimodalParallelizer[{model_type}]", (MultimodalParallelizer,), attributes)


def multimodal_parallelizer(model_type_or_model, registered) -> type[Parallelizer] | None:
    """The Parallelizer of a composite image-text model (a config with `text_config` and `vision_config`), or None.
    `registered(model_type)` gives the registered family of a model type (the manager's registry)."""
    if isinstance(model_type_or_model, str):
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        try:
            config = CONFIG_MAPPING[model_type_or_model]()
        except Exception:  # unknown type, or a config class that cannot be built with defaults
            return None
    else:
        config = getattr(model_type_or_model, "config", model_type_or_model)
    text_config = getattr(config, "text_config", None)
    if text_config is None or getattr(config, "vision_config", None) is None:
        return None
    context_parallel = False
    if isinstance(model_type_or_model, nn.Module):
        try:
            parts = MultimodalParts(model_type_or_model)
            check_context_parallel_parts(model_type_or_model, parts, 2)
            context_parallel = parts.vision_prefix is not None
        except (ValueError, NotImplementedError):
            pass
    text_family = _text_family_of(text_config, registered)
    return _multimodal_class(getattr(config, "model_type", ""), text_family, context_parallel)
