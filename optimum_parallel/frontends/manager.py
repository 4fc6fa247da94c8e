"""ParallelizersManager: model_type -> Parallelizer registry, filled from the entry-point group
`optimum_parallel.parallelizers` (so third-party packages can add families without touching us).

A model type without a registered parallelizer falls back to an automatic one built from its
config's `base_model_tp_plan` (see `auto_plan`); a registered (hand-written) one always wins."""

from __future__ import annotations

import threading
import warnings
from importlib.metadata import EntryPoint

from torch import nn

from ..autoplan.capabilities import Capabilities
from ..plugins import plugin_entry_points
from .auto_plan import auto_parallelizer, auto_plan_model_types
from .multimodal import multimodal_parallelizer
from .parallelizer import Parallelizer

ENTRY_POINT_GROUP = "optimum_parallel.parallelizers"


_DISCOVERY_LOCK = threading.RLock()


class UnsupportedModelError(ValueError):
    """No parallelizer is registered for a model type."""


class ParallelizersManager:
    _registry: dict[str, type[Parallelizer]] = {}
    _entries: dict[str, EntryPoint] = {}  # model type -> its entry point, not loaded yet
    _order: list[str] = []  # model types in the order they became known (entry points first)
    _discovered = False

    @classmethod
    def register(cls, model_type: str, parallelizer: type[Parallelizer]) -> type[Parallelizer]:
        """Register `parallelizer` for `model_type` (a later registration replaces an earlier one)."""
        if not (isinstance(parallelizer, type) and issubclass(parallelizer, Parallelizer)):
            raise TypeError(f"register({model_type!r}, ...) needs a Parallelizer subclass, got {parallelizer!r}")
        cls._registry[model_type] = parallelizer
        if model_type not in cls._order:
            cls._order.append(model_type)
        return parallelizer

    @classmethod
    def _discover(cls) -> None:
        """Read the entry points' names once; each family's module is imported when its model type is first asked
        for. Under a lock, and marked done only after: on XLA one process may run several ranks (one thread
        each), and a rank that saw a half-filled registry would pick another plan."""
        if cls._discovered:
            return
        with _DISCOVERY_LOCK:
            if not cls._discovered:
                for entry in plugin_entry_points(ENTRY_POINT_GROUP):
                    cls._entries.setdefault(entry.name, entry)  # the first of two with one name, as before
                    if entry.name not in cls._order:
                        cls._order.append(entry.name)
                cls._discovered = True

    @classmethod
    def _registered(cls, model_type: str) -> type[Parallelizer] | None:
        """The parallelizer registered for `model_type` (by hand, which wins, or by its entry point, loaded now)."""
        cls._discover()
        with _DISCOVERY_LOCK:
            entry = cls._entries.pop(model_type, None)
            if entry is not None and model_type not in cls._registry:
                try:
                    cls.register(model_type, entry.load())
                except Exception as err:  # a broken third-party plugin must not break the others
                    warnings.warn(f"could not load parallelizer {entry.name!r} ({entry.value}): {err}", stacklevel=3)
            return cls._registry.get(model_type)

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
        types = {model_type for model_type in [*cls._registry, *cls._entries] if cls._registered(model_type)}
        if include_auto:
            types.update(auto_plan_model_types())
        return sorted(types)

    @classmethod
    def is_model_supported(cls, model_type_or_model: str | nn.Module) -> bool:
        if cls._registered(cls._model_type(model_type_or_model)) is not None:
            return True
        automatic = auto_parallelizer(model_type_or_model)
        return (automatic or multimodal_parallelizer(model_type_or_model, cls._registered)) is not None

    @classmethod
    def parallelizer_for_model(cls, model_type_or_model: str | nn.Module) -> type[Parallelizer]:
        """The registered parallelizer of the model type, else one built from its `base_model_tp_plan`."""
        model_type = cls._model_type(model_type_or_model)
        registered = cls._registered(model_type)
        if registered is not None:
            return registered
        automatic = auto_parallelizer(model_type_or_model) or multimodal_parallelizer(
            model_type_or_model, cls._registered
        )
        if automatic is None:  # a vision-language model's text config supported: `multimodal.py`
            raise UnsupportedModelError(
                f"model type {model_type!r} is not supported; supported: "
                f"{', '.join(cls.get_supported_model_types(include_auto=False))}, and model types whose config "
                "carries a base_model_tp_plan made of colwise/rowwise/packed/MoE-expert/replicated styles"
            )
        return automatic

    @classmethod
    def capabilities_of(cls, model: nn.Module) -> Capabilities | None:
        """What `model`'s family supports (None: no family serves it)."""
        try:
            return cls.parallelizer_for_model(model).capabilities_for(model)
        except (UnsupportedModelError, TypeError):
            return None

    @classmethod
    def model_types_with(cls, predicate) -> list[str]:
        """Model types whose hand-written family's capabilities satisfy `predicate`, base families first (Llama's
        before those derived from it); an automatic plan's capabilities depend on each model's structure."""
        cls._discover()
        families = {t: p for t in list(cls._order) if (p := cls._registered(t)) is not None}
        found = sorted(
            (t for t, p in families.items() if predicate(p.capabilities)), key=lambda t: (len(families[t].__mro__), t)
        )
        return found
