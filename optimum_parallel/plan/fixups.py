"""Fix-ups after a plan's modules are swapped: what the swaps alone leave wrong in a Hugging Face model."""

from __future__ import annotations

from fractions import Fraction

from torch import nn

from ..tensor_parallel.layers import ColumnParallelLinear
from ..tensor_parallel.vocab_parallel_loss import VocabParallelLMLoss
from .wrappers import unwrap


def retie_shared_parameters(model: nn.Module, original: dict[str, nn.Parameter]) -> None:
    """Parameters shared before (tied embeddings) stay shared, if every user was split the same way."""
    groups: dict[int, list[str]] = {}
    for name, param in original.items():
        groups.setdefault(id(param), []).append(name)
    for names in (g for g in groups.values() if len(g) > 1):
        owners = [model.get_submodule(n.rpartition(".")[0]) for n in names]
        leaves = [n.rpartition(".")[2] for n in names]
        layouts = [getattr(getattr(m, leaf), "shard_layout", None) for m, leaf in zip(owners, leaves, strict=True)]
        if any(layout != layouts[0] for layout in layouts):
            raise ValueError(
                f"tied parameters {names} are split differently ({layouts}); give every module that shares "
                "them the same style (e.g. vocab-parallel embedding and column-parallel lm_head)"
            )
        shared = getattr(owners[0], leaves[0])
        for module, leaf in zip(owners[1:], leaves[1:], strict=True):
            setattr(module, leaf, shared)


_LOCALIZED = "_optimum_parallel_heads_localized"


def localize_attention_heads(model: nn.Module) -> None:
    """HF attention modules reshape with their own head counts (`num_heads`, `num_key_value_groups`, ...);
    after q/k/v were split in whole heads those must be the rank's local counts: each count scaled by the share of
    its projection this rank holds (a gated query projection, twice as wide as its heads -- Qwen 3.5 -- scales as
    any other). Covers the common HF naming (q_proj/k_proj, query/key, q/k); families with other layouts fix theirs
    in `after_plan`."""
    for module in model.modules():
        head_dim = getattr(module, "head_dim", None)
        if not isinstance(head_dim, int) or head_dim <= 0:
            continue
        columns = {name: unwrap(child) for name, child in module.named_children()}
        share = {
            name: Fraction(child.weight.shape[0], child.out_features)
            for name, child in columns.items()
            if isinstance(child, ColumnParallelLinear)
            and not child.gather_output
            and child.weight.shape[0] % head_dim == 0
        }
        q = next((share[n] for n in ("q_proj", "query", "q") if n in share), None)
        kv = next((share[n] for n in ("k_proj", "key", "k") if n in share), None)
        if q is None or getattr(module, _LOCALIZED, False):  # scaled once, whatever applies a plan again
            continue
        object.__setattr__(module, _LOCALIZED, True)
        for attr in ("num_heads", "num_attention_heads"):
            _scale(module, attr, q)
        if kv:
            _scale(module, "num_key_value_heads", kv)
            _scale(module, "num_key_value_groups", q / kv)


def _scale(module: nn.Module, attr: str, share: Fraction) -> None:
    """`module.attr` (a head count) times this rank's `share`, when the module has it and the result is whole."""
    value = getattr(module, attr, None)
    if isinstance(value, int) and not isinstance(value, bool) and (value * share).denominator == 1:
        setattr(module, attr, int(value * share))


def install_vocab_parallel_loss(model: nn.Module) -> None:
    """A column-parallel LM head without gathered output needs the vocab-parallel loss."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None  # an adapter on it was refused by the plan's check
    if not isinstance(head, ColumnParallelLinear) or head.gather_output:
        return
    loss_type = getattr(model, "loss_type", None)
    shifts = {"ForCausalLM": True, "ForConditionalGeneration": True, "ForMaskedLM": False}
    if loss_type not in shifts:
        raise ValueError(
            f"a vocab-parallel LM head needs a vocab-parallel loss, available for loss types {sorted(shifts)}, "
            f"not {loss_type!r}; use ColWiseParallel(gather_output=True) for this head instead"
        )
    vocab_start = head.weight.shard_layout.ranges[0][0]
    model.loss_function = VocabParallelLMLoss(head.group, vocab_start, shift=shifts[loss_type])
