"""Small helpers shared by the family parallelizers: head checks, name prefixes, per-rank config views."""

from __future__ import annotations

from torch import nn

from optimum_parallel import Parallelizer
from optimum_parallel.tensor_parallel.spec import check_attention_heads as check_heads

__all__ = ["LocalConfig", "check_heads", "local_heads", "prefix"]


class LocalConfig:
    """A view of a shared model config with a few attributes replaced for this rank's module.

    Some attention modules read head counts from `self.config` at run time (Phi-3's fused qkv split);
    the shared config must keep the global values, so the module gets this view instead. Everything
    not overridden (e.g. `_attn_implementation`) is read from, and written to, the real config.
    """

    def __init__(self, config, **overrides) -> None:
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_overrides", overrides)

    def __getattr__(self, name: str):
        if name in ("_config", "_overrides") or name.startswith("__"):
            raise AttributeError(name)
        if name in self._overrides:
            return self._overrides[name]
        return getattr(self._config, name)

    def __setattr__(self, name: str, value) -> None:
        if name in self._overrides:
            self._overrides[name] = value
        else:
            setattr(self._config, name, value)

    def __repr__(self) -> str:
        return f"LocalConfig({type(self._config).__name__}, {self._overrides})"


def prefix(model: nn.Module) -> str:
    """Regex of the base-model prefix ('model\\.' for LlamaForCausalLM, '' for the bare base model)."""
    return Parallelizer.base_model_prefix(model).replace(".", r"\.")


def local_heads(projection: nn.Module, head_dim: int, dim: int = 0) -> int:
    """Heads held by this rank's split projection (its local output features / head_dim)."""
    return projection.weight.shape[dim] // head_dim
