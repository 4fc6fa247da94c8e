"""ParallelizersManager: model_type -> Parallelizer registry, filled from the entry-point group
`optimum_parallel.parallelizers` (so third-party packages can add families without touching us).

A model type without a registered parallelizer falls back to an automatic one built from its
config's `base_model_tp_plan` (see `auto_plan`); a registered (hand-written) one always wins."""

from __future__ import annotations

import threading
import warnings

from torch import nn

from ..plugins import plugin_entry_points
from .auto_plan import auto_parallelizer, auto_plan_model_types
from .parallelizer import Parallelizer

ENTRY_POINT_GROUP = "optimum_parallel.parallelizers"


_DISCOVERY_LOCK = threading.Lock()


class UnsupportedModelError(ValueError):
    """No parallelizer is registered for a model type."""


class ParallelizersManager:
    _registry: dict[str, type[Parallelizer]] = {}
    _discovered = False

    @classmethod
    def register(cls, model_type: str, parallelizer: type[Parallelizer]) -> type[Parallelizer]:
        """Register `parallelizer` for `model_type` (a later registration replaces an earlier one)."""
        if not (isinstance(parallelizer, type) and issubclass(parallelizer, Parallelizer)):
            raise TypeError(f"register({model_type!r}, ...) needs a Parallelizer subclass, got {parallelizer!r}")
        cls._registry[model_type] = parallelizer
        return parallelizer

    @classmethod
    def _discover(cls) -> None:
        """Load the entry points once; under a lock, and marked done only after: on XLA one process may run
        several ranks (one thread each), and a rank that saw a half-filled registry would pick another plan."""
        if cls._discovered:
            return
        with _DISCOVERY_LOCK:
            if cls._discovered:
                return
            for entry in plugin_entry_points(ENTRY_POINT_GROUP):
                if entry.name in cls._registry:  # registered by hand: keep it
                    continue
                try:
                    cls.register(entry.name, entry.load())
                except Exception as err:  # a broken third-party plugin must not break the others
                    warnings.warn(f"could not load parallelizer {entry.name!r} ({entry.value}): {err}", stacklevel=2)
            cls._discovered = True

    @staticmethod
    def _model_type(model_type_or_model: str | nn.Module) -> str:
        if isinstance(model_type_or_model, str):
            return model_type_or_model
        config = getattr(model_type_or_model, "config", model_type_or_model)
        model_type = getattr(config, "model_type", None)
        if not model_type:
            raise TypeError(f"expected a model type string or a transformers model/config, got {model_type_or_model!r}")
        return model_type

    @classmethod
    def get_supported_model_types(cls, include_auto: bool = True) -> list[str]:
        """Model types with a registered parallelizer and, with `include_auto`, those served by an
        automatic plan from `base_model_tp_plan` (finding those imports every transformers config class)."""
        cls._discover()
        types = set(cls._registry)
        if include_auto:
            types.update(auto_plan_model_types())
        return sorted(types)

    @classmethod
    def is_model_supported(cls, model_type_or_model: str | nn.Module) -> bool:
        cls._discover()
        if cls._model_type(model_type_or_model) in cls._registry:
            return True
        return auto_parallelizer(model_type_or_model) is not None

    @classmethod
    def parallelizer_for_model(cls, model_type_or_model: str | nn.Module) -> type[Parallelizer]:
        """The registered parallelizer of the model type, else one built from its `base_model_tp_plan`."""
        cls._discover()
        model_type = cls._model_type(model_type_or_model)
        if model_type in cls._registry:
            return cls._registry[model_type]
        automatic = auto_parallelizer(model_type_or_model)
        if automatic is None:
            raise UnsupportedModelError(
                f"model type {model_type!r} is not supported; supported: "
                f"{', '.join(cls.get_supported_model_types(include_auto=False))}, and model types whose config "
                "carries a base_model_tp_plan made of colwise/rowwise/packed/MoE-expert/replicated styles"
            )
        return automatic
