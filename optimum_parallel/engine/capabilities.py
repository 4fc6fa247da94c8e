"""What a model family supports, declared once in its family file (`Parallelizer.capabilities`), and how the engine
asks for it: every room that depends on a family's support asks through here, never through a list of model types.

The family registry (`frontends/manager.py`, above the engine) registers its lookup when it is imported, so a request
that names no family (Paddle's door, an explicit plan) still finds the model's family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

LLAMA_ACTIVATIONS = "llama"  # RMSNorm, SwiGLU, no dropout: the planner's Llama activation count applies


@dataclass(frozen=True)
class Capabilities:
    """`sequence_parallel`: the family's plan honours sequence_parallel_enabled; `pipeline_parallel`: its decoder
    splits into pipeline stages; `context_parallel`: every cross-token computation is attention through
    transformers' AttentionInterface, tested against one device under cp; `activations`: the planner's activation
    formula (`LLAMA_ACTIVATIONS`, or None when the planner has none for it)."""

    sequence_parallel: bool = False
    pipeline_parallel: bool = False
    context_parallel: bool = False
    activations: str | None = None


NONE = Capabilities()
_lookup: Callable[[nn.Module], Capabilities | None] | None = None
_listing: Callable[[Callable[[Capabilities], bool]], list[str]] | None = None


def register_family_lookup(
    lookup: Callable[[nn.Module], Capabilities | None], listing: Callable[[Callable[[Capabilities], bool]], list[str]]
) -> None:
    """Called by the family registry: `lookup(model)` gives the capabilities of the model's family (None: no family),
    `listing(predicate)` the model types whose family's capabilities satisfy `predicate`."""
    global _lookup, _listing
    _lookup, _listing = lookup, listing


def capabilities_of(model: nn.Module) -> Capabilities:
    """The capabilities of `model`'s family (none when it has no family)."""
    found = _lookup(model) if _lookup is not None else None
    return found or NONE


def model_types_with(predicate: Callable[[Capabilities], bool]) -> list[str]:
    """The model types whose family declares what `predicate` asks (for error messages)."""
    return _listing(predicate) if _listing is not None else []
