"""Where a decoder's parts sit, found from its structure rather than from fixed names: the base model holding the layer
list, its token embedding (the model's input embeddings), its final norm, and the head (the model's output
embeddings). Falcon-H1's `final_layernorm`, Nemotron-H's `embeddings` / `norm_f` and LFM2's `embedding_norm` are
found as Llama's `embed_tokens` / `norm` are.

Every other child of the base model that holds parameters would have to run on some stage in some order the pipeline
cannot know (Gemma 4's per-layer input embeddings read `input_ids` inside every layer's input): such a model is
refused, naming those modules. Parameter-less children (rotary embeddings) are recomputed on every stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class DecoderRoles:
    """`base`: the module holding the layer list; `embedding` / `final_norm` / `layers`: attribute names in it;
    `head`: the attribute of the model holding the output embeddings; `unplaced`: the base's parameter-holding
    children in no role (each named in the refusal)."""

    base: nn.Module
    layers: str
    embedding: str | None
    final_norm: str | None
    head: str | None
    unplaced: tuple[str, ...]

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


def decoder_roles(model: nn.Module, base: nn.Module, layers: str) -> DecoderRoles:
    """The roles of `base`'s children (`layers` names its layer list); see the module docstring."""
    get_input = getattr(model, "get_input_embeddings", None)
    get_output = getattr(model, "get_output_embeddings", None)
    embedding = _child_named(base, get_input() if get_input is not None else None)
    head = _child_named(model, get_output() if get_output is not None else None)
    norms = [name for name, child in base.named_children() if is_norm(child)]
    final_norm = norms[0] if len(norms) == 1 else ("norm" if "norm" in norms else None)
    placed = {layers, embedding, final_norm}
    unplaced = tuple(name for name, child in base.named_children() if name not in placed and _holds_parameters(child))
    return DecoderRoles(base, layers, embedding, final_norm, head, unplaced)
