"""Sequence parallelism for an automatic plan whose model is a Llama-shaped decoder: `base.layers[i]` each made of
norms, a `self_attn` block and one MLP or mixture-of-experts block, then `base.norm`.

It is Megatron's, as the Llama family writes it: the sequence is split from the first decoder layer's input, the
norms run on the slices (their gradients summed over tp), attention and the MLP run on the whole sequence (gathered
at the block's entry; column/row layers inside keep their tp split and reduce-scatter the output), and the LM head
gathers the sequence. A block holding stacked experts is replicated work on the whole sequence, its column/row layers
(a shared expert) plain tensor parallelism inside it, so their whole-sequence output adds to the experts' one.
"""

from __future__ import annotations

import re

from torch import nn

from ..expert_parallel import find_experts
from ..styles import SequenceParallelBegin, SequenceParallelDisable, SequenceParallelEnable


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _block_style(name: str, module: nn.Module) -> SequenceParallelDisable | SequenceParallelEnable | None:
    """How one child of a decoder layer runs under sequence parallelism (None: as it is, on the slice)."""
    if _is_norm(module):
        return SequenceParallelEnable()
    if name == "self_attn":
        return SequenceParallelDisable()
    if not _has_parameters(module):
        return None
    return SequenceParallelDisable(replicate=bool(find_experts(module)))


def llama_shaped(base: nn.Module) -> bool:
    """Whether `base` (the base model) is a Llama-shaped decoder this plan fits (see the module docstring)."""
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers) or not _is_norm(getattr(base, "norm", None)):
        return False
    for layer in layers:
        children = dict(layer.named_children())
        blocks = [n for n, m in children.items() if n != "self_attn" and not _is_norm(m) and _has_parameters(m)]
        if "self_attn" not in children or len(blocks) != 1:
            return False
    return True


def sequence_parallel_plan(base: nn.Module, prefix: str) -> dict:
    """The plan entries of sequence parallelism for the Llama-shaped decoder `base`, whose names start with the regex
    `prefix`; layers whose blocks differ (dense first layers beside MoE ones) get keys of their own."""
    if not llama_shaped(base):
        raise NotImplementedError(
            f"sequence_parallel_enabled=True: {type(base).__name__} is not a Llama-shaped decoder (layers of norms, "
            "one self_attn and one MLP block, then norm); allowed for this model: False"
        )
    plan: dict = {prefix + r"layers\.0": SequenceParallelBegin(on="input")}
    groups: dict[tuple[str, str], tuple[object, list[int]]] = {}  # (child, style) -> the layers that have it
    for index, layer in enumerate(base.layers):
        for name, module in layer.named_children():
            style = _block_style(name, module)
            if style is not None:
                groups.setdefault((name, repr(style)), (style, []))[1].append(index)
    for (name, _), (style, indices) in groups.items():
        which = r"\d+" if len(indices) == len(base.layers) else "(" + "|".join(map(str, indices)) + ")"
        plan[prefix + rf"layers\.{which}\." + re.escape(name)] = style
    plan[prefix + "norm"] = SequenceParallelEnable()
    return plan
