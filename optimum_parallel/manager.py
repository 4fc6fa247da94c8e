"""ParallelizersManager: model_type -> Parallelizer registry, filled from the entry-point group
`optimum_parallel.parallelizers` (so third-party packages can add families without touching us)."""

from __future__ import annotations

import warnings
from importlib.metadata import entry_points

from torch import nn

from .parallelizer import Parallelizer

ENTRY_POINT_GROUP = "optimum_parallel.parallelizers"


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
        if cls._discovered:
            return
        cls._discovered = True
        for entry in entry_points(group=ENTRY_POINT_GROUP):
            if entry.name in cls._registry:  # registered by hand: keep it
                continue
            try:
                cls.register(entry.name, entry.load())
            except Exception as err:  # a broken third-party plugin must not break the others
                warnings.warn(f"could not load parallelizer {entry.name!r} ({entry.value}): {err}", stacklevel=2)

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
    def get_supported_model_types(cls) -> list[str]:
        cls._discover()
        return sorted(cls._registry)

    @classmethod
    def is_model_supported(cls, model_type_or_model: str | nn.Module) -> bool:
        cls._discover()
        return cls._model_type(model_type_or_model) in cls._registry

    @classmethod
    def parallelizer_for_model(cls, model_type_or_model: str | nn.Module) -> type[Parallelizer]:
        cls._discover()
        model_type = cls._model_type(model_type_or_model)
        if model_type not in cls._registry:
            raise UnsupportedModelError(
                f"model type {model_type!r} is not supported; supported: {', '.join(cls.get_supported_model_types())}"
            )
        return cls._registry[model_type]
