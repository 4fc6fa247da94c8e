"""Activations with learnable parameters inside a split MLP, which transformers' tp plans leave out: Apertus's xIELU
(`alpha_p`, `alpha_n`) acts elementwise on the column-split intermediate, so each tp rank's use of its scalars holds
only its features' share of their gradient. The automatic plan gives such an activation `ReplicatedWithGradAllReduce`
(kept whole, gradients summed over tp)."""

from __future__ import annotations

import re

from torch import nn

from ..styles import ColWiseParallel, ReplicatedWithGradAllReduce, optional


def _is_activation(module: nn.Module) -> bool:
    """One of transformers' activation modules (`transformers.activations`) holding parameters of its own."""
    return type(module).__module__ == "transformers.activations" and any(True for _ in module.parameters(False))


def split_activation_entries(model: nn.Module, plan: dict[str, object]) -> dict[str, object]:
    """Plan entries (regex -> ReplicatedWithGradAllReduce) for the learnable activations of `model` whose sibling
    linear layer is column-split (not gathered) by `plan`: they act on the split intermediate."""
    split = [re.compile(regex) for regex, style in plan.items() if _column_split(style)]
    entries: dict[str, object] = {}
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if not _is_activation(module) or any(re.fullmatch(regex, name) for regex in plan):
            continue
        parent = name.rpartition(".")[0]
        siblings = [f"{parent}.{child}" if parent else child for child, _ in modules[parent].named_children()]
        if any(pattern.fullmatch(sibling) for sibling in siblings for pattern in split):
            entries[re.escape(name)] = optional(ReplicatedWithGradAllReduce())
    return entries


def _column_split(style: object) -> bool:
    styles = style.styles if isinstance(style, optional) else style
    styles = styles if isinstance(styles, list) else [styles]
    return any(isinstance(s, ColWiseParallel) and not s.gather_output for s in styles)
