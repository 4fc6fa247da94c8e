"""What a model's structure allows beyond tensor parallelism (pipeline, sequence and context parallelism), found once
per request from the modules it is made of, layer by layer, not from a list of model types (a hand-written family's
declaration still wins). `derive_capabilities` returns the `Capabilities`, each refusal's reason naming the module and
the layer; `decoder_stack`, `state_mixers` and `sequence_parallel_blocks` describe the decoder.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import cache

from torch import nn

from ..context_parallel import classifier_head
from ..expert_parallel import find_experts
from ..mixers import builds_recurrent_mask
from ..pipeline.decoder import DecoderRoles, decoder_roles, is_norm
from .capabilities import Capabilities

ATTENTION_INTERFACE_MARKS = ("ALL_ATTENTION_FUNCTIONS", "attention_interface")


@dataclass(frozen=True)
class DecoderStack:
    """A decoder's layer list and the roles of the parts around it; `prefix`: the layer list's dotted name."""

    prefix: str
    layers: nn.ModuleList
    roles: DecoderRoles

    def unplaced(self) -> str:
        """The full names of the base model's parameter-holding children in no role, comma-separated."""
        base = self.prefix.rpartition(".")[0]
        return ", ".join(f"{base}.{name}" if base else name for name in self.roles.unplaced)


def _base_of(model: nn.Module) -> tuple[str, nn.Module]:
    """(name, module) of the base model: `base_model_prefix`'s attribute, else the decoder transformers' `get_decoder`
    gives, else a child named `model` (Llama 4's text model is `model`, its prefix `language_model`), else the model
    itself."""
    prefix = getattr(model, "base_model_prefix", "")
    get_decoder = getattr(model, "get_decoder", None)
    candidates = [getattr(model, prefix, None) if prefix else None, get_decoder() if callable(get_decoder) else None]
    candidates.append(getattr(model, "model", None))
    for base in candidates:
        if isinstance(base, nn.Module) and base is not model:
            name = next((n for n, m in model.named_modules() if m is base and n), None)
            if name:
                return name, base
    return "", model


def decoder_stack(model: nn.Module) -> DecoderStack | None:
    """The decoder stack of `model` (None: no layer list found): the base model's `ModuleList` of the layer classes
    transformers marks `_no_split_modules`, else its `layers`."""
    base_name, base = _base_of(model)
    marked = set(getattr(model, "_no_split_modules", None) or ())
    lists = [(n, c) for n, c in base.named_children() if isinstance(c, nn.ModuleList) and len(c)]
    found = [(n, c) for n, c in lists if marked and all(type(layer).__name__ in marked for layer in c)]
    if not found:
        found = [(n, c) for n, c in lists if n == "layers"]
    if len(found) != 1:
        return None
    name, layers = found[0]
    prefix = f"{base_name}.{name}" if base_name else name
    return DecoderStack(prefix, layers, decoder_roles(model, base, name))


@cache
def _calls_attention_interface(cls: type) -> bool:
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return any(mark in source for mark in ATTENTION_INTERFACE_MARKS)


def is_interface_attention(module: nn.Module) -> bool:
    """Whether `module` (or a module inside it) computes its attention through transformers' attention interface."""
    return any(_calls_attention_interface(type(m)) for m in module.modules())


def _token_wise(module: nn.Module) -> bool:
    """Whether `module` holds only linear layers and parameter-less modules (an MLP): it works token by token."""
    leaves = [m for m in module.modules() if m is not module]
    own = any(p is not None for p in module._parameters.values())
    return not own and all(isinstance(m, nn.Linear) or next(m.parameters(), None) is None for m in leaves)


def is_token_mixer(module: nn.Module) -> bool:
    """Whether a decoder layer's child mixes tokens: transformers gives every such mixer its layer's `layer_idx`
    (attention, Mamba, delta nets, short convolutions; an MLP carrying one too, as Hunyuan's does, works token by
    token); a 1-D convolution inside one mixes neighbouring tokens too."""
    if any(isinstance(m, nn.Conv1d) for m in module.modules()):
        return True
    return hasattr(module, "layer_idx") and (is_interface_attention(module) or not _token_wise(module))


def _inner_mixer(attention: nn.Module) -> tuple[str, nn.Module] | None:
    """(name, module) of a module inside an attention block that mixes tokens on its own: its own `layer_idx` and
    parameters beyond linear layers, a convolution over the sequence, or parameters of its own that are no layer's
    weight or bias (DeepSeek-V4's compressor's per-position biases over a window); None when there is none."""
    for name, module in attention.named_modules():
        if module is attention or not name or is_interface_attention(module):
            continue
        own = {n for n, p in module.named_parameters(recurse=False) if p is not None} - {"weight", "bias"}
        if is_token_mixer(module) or own:
            return name, module
    return None


def _takes_mask(mixer: nn.Module) -> bool:
    parameters = inspect.signature(type(mixer).forward).parameters
    return "hidden_states" in parameters and "attention_mask" in parameters


def state_mixers(model: nn.Module) -> list[str]:
    """The names of every decoder layer's token mixers that carry a state along the sequence (not attention through
    transformers' interface), the language model's of a vision-language model included."""
    found: list[str] = []
    for name, layers in model.named_modules():  # the children of every layer of every layer list
        if not isinstance(layers, nn.ModuleList) or any(name.startswith(done + ".") for done in found):
            continue
        for index, layer in enumerate(layers):
            for child_name, child in layer.named_children():
                if is_token_mixer(child) and not is_interface_attention(child):
                    found.append(f"{name}.{index}.{child_name}" if name else f"{index}.{child_name}")
    return found


def _kv_shared_layer(stack: DecoderStack) -> str | None:
    """The first attention reading the keys and values an earlier layer stored (Gemma 4's kv-shared layers, the last
    config.num_kv_shared_layers), named with what it reads; None when no layer does."""
    for index, layer in enumerate(stack.layers):
        for name, child in layer.named_children():
            if getattr(child, "is_kv_shared_layer", False) is True:
                shared = getattr(getattr(child, "config", None), "num_kv_shared_layers", "?")
                return (
                    f"{stack.prefix}.{index}.{name} ({type(child).__name__}) reads the keys and values an earlier "
                    f"layer stored (config.num_kv_shared_layers={shared})"
                )
    return None


def _context_parallel_blocker(model: nn.Module, stack: DecoderStack, needs_head: bool = True) -> str | None:
    """Why cp cannot run `model`'s layers (None: every token mixer is interface attention it computes)."""
    config = getattr(model, "config", None)
    chunk = getattr(config, "attention_chunk_size", None)
    if stack.roles.unplaced:
        return f"{stack.unplaced()} feed the layers inputs outside the residual stream that the cp split does not place"
    shared = _kv_shared_layer(stack)
    if shared is not None:
        return f"{shared}, which the context-parallel attention does not route"
    for index, layer in enumerate(stack.layers):
        for name, child in layer.named_children():
            if not is_token_mixer(child):
                continue
            where = f"{stack.prefix}.{index}.{name} ({type(child).__name__})"
            if not is_interface_attention(child):
                if not builds_recurrent_mask(stack.roles.base):
                    return (
                        f"{where} carries a state along the sequence, and {type(stack.roles.base).__name__} does not "
                        "build its mixers' mask with transformers' create_recurrent_attention_mask, through which the "
                        "cp layout reaches them"
                    )
                if not _takes_mask(child):
                    return f"{where} carries a state along the sequence and takes no attention_mask argument"
                continue
            if not any(hasattr(m, "num_key_value_groups") for m in child.modules()):
                return f"{where} is not a query/key/value attention with key/value groups that the cp split routes"
            inner = _inner_mixer(child)
            if inner is not None:  # DeepSeek sparse attention's indexer: keys picked over the whole sequence
                return (
                    f"{where} holds {inner[0]} ({type(inner[1]).__name__}), which reads the whole sequence beside the "
                    "attention (it picks or compresses keys); the context-parallel attention computes neither"
                )
            sinks = getattr(child, "sinks", None)
            if isinstance(sinks, nn.Parameter) and sinks.dim() != 1:  # one logit per head joins its softmax: computed
                return (
                    f"{where} has attention sinks of shape {tuple(sinks.shape)} (not one logit per head), which the "
                    "context-parallel attention does not compute"
                )
            types = getattr(getattr(child, "config", config), "layer_types", None)
            named = isinstance(types, (list, tuple)) and isinstance(getattr(child, "layer_idx", None), int)
            if chunk and not named:
                return (  # the chunked layers are the ones config.layer_types names 'chunked_attention'
                    f"{where} may use chunked attention (attention_chunk_size={chunk}), and config.layer_types does "
                    "not say which layers do, which the context-parallel attention reads"
                )
    if needs_head and not hasattr(model, "lm_head") and classifier_head(model) is None:
        return (
            f"{type(model).__name__} has no LM head (context parallelism runs causal language models and their "
            "sequence classifiers)"
        )
    return None


def context_parallel_layer_blocker(language_model: nn.Module) -> str | None:
    """Why cp cannot run the token mixers of `language_model`'s layers (None: it can), for a language model inside
    a composite model (its LM head sits beside it): the same per-layer check as a text model's."""
    stack = decoder_stack(language_model)
    if stack is None:
        return f"{type(language_model).__name__} has no decoder layer list"
    if stack.roles.per_layer:  # the composite model's entry computes them from the whole sequence's token ids
        names = ", ".join(stack.roles.per_layer)
        return (
            f"{names} compute per-layer inputs that the composite model passes whole, which the cp split does not cut"
        )
    return _context_parallel_blocker(language_model, stack, needs_head=False)


def _sequence_parallel_blocker(stack: DecoderStack) -> str | None:
    """Why the residual stream between `stack`'s blocks cannot run on sequence slices (None: it can)."""
    if stack.roles.final_norm is None:
        return f"no final norm found beside {stack.prefix} (the region ends at the LM head, after the norm)"
    if stack.roles.unplaced:
        return (
            f"{stack.unplaced()} hold parameters outside the decoder layers, the embedding and the final norm (inputs "
            "beside the residual stream, or work between the layers and the norm), where the sequence split places "
            "nothing"
        )
    return None


def derive_capabilities(model: nn.Module) -> Capabilities:
    """What `model`'s structure allows (see `docs/module_notes.md`), with the reason for each layout it refuses."""
    stack = decoder_stack(model)
    if stack is None:
        reason = f"{type(model).__name__} has no decoder layer list (a ModuleList of its _no_split_modules classes)"
        return Capabilities(refusals=(("sequence", reason), ("pipeline", reason), ("context", reason)))
    refusals = []
    missing = stack.roles.missing()
    if missing or stack.roles.unplaced:
        what = (
            f"no {' and no '.join(missing)} found"
            if missing
            else f"{stack.unplaced()} hold parameters outside the decoder layers, the embedding and the final norm"
        )
        refusals.append(("pipeline", f"{type(model).__name__}: {what}"))
    elif _kv_shared_layer(stack) is not None:
        refusals.append(("pipeline", f"{_kv_shared_layer(stack)}, which another pipeline stage may hold"))
    sequence = _sequence_parallel_blocker(stack)
    if sequence is not None:
        refusals.append(("sequence", sequence))
    context = _context_parallel_blocker(model, stack)
    if context is not None:
        refusals.append(("context", context))
    refused = {layout for layout, _ in refusals}
    return Capabilities(
        sequence_parallel="sequence" not in refused,
        pipeline_parallel="pipeline" not in refused,
        context_parallel="context" not in refused,
        refusals=tuple(refusals),
    )


def sequence_parallel_blocks(layer: nn.Module) -> list[tuple[str, str]]:
    """(child name, how it runs under sequence parallelism) for one decoder layer: 'slice' for norms (on the local
    slice, gradients summed over tp), 'whole' for blocks with parameters (gathered at their entry), 'replicate' for
    blocks holding stacked experts (replicated work on the whole sequence); parameter-less children run as they are.
    A list of blocks (LongCat-Flash's two attentions, MLPs and norms a layer) is never called itself: its members are
    (dotted names, `self_attn.0`)."""
    found = []
    children = []
    for name, child in layer.named_children():
        members = child.named_children() if isinstance(child, nn.ModuleList) else [("", child)]
        children.extend((f"{name}.{index}" if index else name, member) for index, member in members)
    for name, child in children:
        if is_norm(child):
            found.append((name, "slice"))
        elif next(child.parameters(), None) is not None:
            found.append((name, "replicate" if find_experts(child) else "whole"))
    return found
