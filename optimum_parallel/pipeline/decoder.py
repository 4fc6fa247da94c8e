"""Where a decoder's parts sit, found from its structure rather than from fixed names: `decoder_roles` returns a model's
`DecoderRoles` -- the base model holding the layer list, its token embedding, final norm and head, the modules that
compute its per-layer inputs, and a vision-language model's entry and first-stage modules. `is_norm` tells a
normalisation layer. Design notes: docs/module_notes.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..context_parallel import classifier_head
from .per_layer import per_layer_modules


@dataclass(frozen=True)
class DecoderRoles:
    """`base`: the module holding the layer list; `embedding` / `final_norm` / `layers`: attribute names in it;
    `head`: the attribute of the model holding the output embeddings, or a sequence classifier's head (`classifier`:
    the last stage gives every position's scores, which the caller pools: no stage holds the token ids); `unplaced`:
    the base's parameter-holding children in no role (each named in the refusal); `entry`: the module every stage
    calls when it is not the base (a vision-language model's, holding the base and modules that run before it);
    `first_stage`: (parent, attribute) of the entry's modules outside the base, which run on the first stage only
    (vision tower, projector); `outside`: the model's parameter-holding children beside the entry and the head
    (refused); `per_layer`: the base's children computing its per-layer inputs (Gemma 4's `embed_tokens_per_layer`,
    `per_layer_model_projection`, `per_layer_projection_norm`), run with the embedding."""

    base: nn.Module
    layers: str
    embedding: str | None
    final_norm: str | None
    head: str | None
    unplaced: tuple[str, ...]
    entry: nn.Module | None = None
    first_stage: tuple[tuple[nn.Module, str], ...] = ()
    outside: tuple[str, ...] = ()
    per_layer: tuple[str, ...] = ()
    classifier: bool = False

    @property
    def caller(self) -> nn.Module:
        """The module a stage calls: the entry, the base when there is no other."""
        return self.entry if self.entry is not None else self.base

    def missing(self) -> list[str]:
        """The roles a pipeline needs that the model does not fill."""
        roles = {"token embedding": self.embedding, "final norm": self.final_norm, "LM head": self.head}
        return [role for role, name in roles.items() if name is None]


def is_norm(module: nn.Module | None) -> bool:
    """A normalisation layer (torch's or a transformers `*RMSNorm` / `*LayerNorm` class)."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _child_named(parent: nn.Module, module: nn.Module | None) -> str | None:
    return next((name for name, child in parent.named_children() if child is module), None) if module else None


def _entry_of(model: nn.Module, base: nn.Module) -> tuple[nn.Module, list[tuple[nn.Module, str]], list[str]]:
    """(the entry: the model's child holding `base`, or `base`; the parameter-holding modules beside the path from the
    entry down to `base`, as (parent, attribute); the model's parameter-holding children beside the entry)."""
    path = next((name for name, module in model.named_modules() if module is base), None)
    if not path or "." not in path:
        return base, [], []
    parts = path.split(".")
    entry = model.get_submodule(parts[0])
    beside_entry = [name for name, child in model.named_children() if name != parts[0] and _holds_parameters(child)]
    first_stage, parent = [], entry
    for step in parts[1:]:
        first_stage += [(parent, n) for n, child in parent.named_children() if n != step and _holds_parameters(child)]
        parent = getattr(parent, step)
    return entry, first_stage, beside_entry


def decoder_roles(model: nn.Module, base: nn.Module, layers: str) -> DecoderRoles:
    """The roles of `base`'s children (`layers` names its layer list) and of the entry holding it (see
    docs/module_notes.md)."""
    get_input = getattr(model, "get_input_embeddings", None)
    get_output = getattr(model, "get_output_embeddings", None)
    embedding = _child_named(base, get_input() if get_input is not None else None)
    head = _child_named(model, get_output() if get_output is not None else None)
    classifier = head is None and classifier_head(model) is not None
    if classifier:
        head = _child_named(model, classifier_head(model))
    norms = [name for name, child in base.named_children() if is_norm(child)]
    final_norm = norms[0] if len(norms) == 1 else ("norm" if "norm" in norms else None)
    entry, first_stage, beside = _entry_of(model, base)
    # a composite model's entry computes the per-layer inputs itself, from ids it holds before merging the images
    found = per_layer_modules(base, getattr(base, layers)) if not first_stage else ()
    per_layer = tuple(name for name in found if name != embedding)  # Gemma 4 reads it to invert an embeds-only call
    placed = {layers, embedding, final_norm, *per_layer}
    unplaced = tuple(name for name, child in base.named_children() if name not in placed and _holds_parameters(child))
    if not first_stage:  # nothing runs before the base: the stages call it directly
        return DecoderRoles(
            base, layers, embedding, final_norm, head, unplaced, per_layer=per_layer, classifier=classifier
        )
    outside = tuple(name for name in beside if name != head)
    return DecoderRoles(base, layers, embedding, final_norm, head, unplaced, entry, tuple(first_stage), outside)
