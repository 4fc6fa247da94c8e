"""Sequence parallelism planned from a decoder's structure (`autoplan/structure.py`): Megatron's, as the Llama family
writes it, for any decoder stack whose residual stream between blocks is token-wise. `sequence_parallel_plan` gives
the plan entries for a model's decoder stack, given its tp plan.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..pipeline.per_layer import LAYER_ARGUMENT
from ..styles import (
    PrepareLayerOutput,
    RowWiseParallel,
    SequenceParallelBegin,
    SequenceParallelDisable,
    SequenceParallelEnable,
    SequenceParallelSplitArgument,
    optional,
)
from .structure import decoder_stack, derive_capabilities, sequence_parallel_blocks


def _in_input_shape(module: nn.Module, args: tuple, output):
    """A block's output in its input's [batch, seq, ...] shape where the block flattened the tokens (Llama 4's MoE
    returns [batch x seq, hidden]): the sequence split after it must cut the sequence, not the hidden dim."""
    first = output[0] if isinstance(output, tuple) and output else output
    x = args[0] if args else None
    if not (torch.is_tensor(first) and torch.is_tensor(x)) or first.dim() != 2 or x.dim() < 3:
        return None
    if first.shape[0] != x.shape[:-1].numel():
        return None
    shaped = first.view(*x.shape[:-1], first.shape[-1])
    return (shaped, *output[1:]) if isinstance(output, tuple) else shaped


_STYLES = {
    "slice": SequenceParallelEnable,
    "whole": SequenceParallelDisable,
    "replicate": lambda: [PrepareLayerOutput(_in_input_shape), SequenceParallelDisable(replicate=True)],
}


def _row_exits(plan: dict) -> list[str]:
    """The regexes of `plan` that put a row-parallel layer somewhere: where a tp region leaves, reduce-scattering
    the sequence under sequence parallelism."""
    found = []
    for regex, value in plan.items():
        styles = value.styles if isinstance(value, optional) else value
        if any(isinstance(style, RowWiseParallel) for style in (styles if isinstance(styles, list) else [styles])):
            found.append(regex)
    return found


def _leaves_through_row_layer(block: nn.Module, name: str, exits: list[str]) -> bool:
    return any(re.fullmatch(regex, f"{name}.{sub}") for sub, _ in block.named_modules() if sub for regex in exits)


def _whole_linear(block: nn.Module, name: str, plan: dict) -> bool:
    """A plain linear layer no plan key names: token-wise work that runs on the slices (its gradients summed)."""
    return type(block) is nn.Linear and not any(re.fullmatch(regex, name) for regex in plan)


def sequence_parallel_plan(model: nn.Module, plan: dict) -> dict:
    """The plan entries of sequence parallelism for `model`'s decoder stack (full names as regexes), given its tp
    `plan`; layers whose children differ (dense first layers beside MoE ones, attention beside Mamba layers) get
    keys of their own. A block whose tp region never leaves through a row-parallel layer (Qwen 3.5's delta nets,
    whose projections all gather their outputs) is replicated work on the whole sequence: gathered in, split out."""
    stack = decoder_stack(model)
    why = derive_capabilities(model).reason("sequence")
    if stack is None or why is not None:
        raise NotImplementedError(
            f"sequence_parallel_enabled=True is not supported for {type(model).__name__}: {why}; allowed for this "
            "model: False"
        )
    layers = re.escape(stack.prefix)
    exits = _row_exits(plan)
    entries: dict = {layers + r"\.0": SequenceParallelBegin(on="input")}
    groups: dict[tuple[str, str], list[int]] = {}  # (child, how it runs) -> the layers that have it
    for index, layer in enumerate(stack.layers):
        for name, how in sequence_parallel_blocks(layer):
            block = layer.get_submodule(name)
            full = f"{stack.prefix}.{index}.{name}"
            if how == "whole" and _whole_linear(block, full, plan):
                how = "slice"
            elif how == "whole" and not _leaves_through_row_layer(block, full, exits):
                how = "replicate"
            groups.setdefault((name, how), []).append(index)
    for (name, how), indices in groups.items():
        which = r"\d+" if len(indices) == len(stack.layers) else "(" + "|".join(map(str, indices)) + ")"
        entries[layers + rf"\.{which}\." + re.escape(name)] = _STYLES[how]()
    if stack.roles.per_layer:  # each layer's slice of the per-layer inputs, cut as its hidden states are
        entries[layers + r"\.\d+"] = SequenceParallelSplitArgument(LAYER_ARGUMENT)
    base = stack.prefix.rpartition(".")[0]
    final_norm = f"{base}.{stack.roles.final_norm}" if base else stack.roles.final_norm
    entries[re.escape(final_norm)] = SequenceParallelEnable()
    return entries
