"""ParallelizersManager: entry-point discovery, lookups, registration and errors (no processes needed)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest
from _models import tiny_config

import optimum_parallel as op


def test_families_register_through_entry_points():
    names = {e.name for e in entry_points(group="optimum_parallel.parallelizers")}
    assert {"llama", "mistral", "qwen2"} <= names
    assert {"llama", "mistral", "qwen2"} <= set(op.ParallelizersManager.get_supported_model_types())


def test_lookup_by_type_model_or_config():
    config = tiny_config("mistral")
    assert op.ParallelizersManager.is_model_supported("llama")
    assert op.ParallelizersManager.is_model_supported(config)
    assert issubclass(op.ParallelizersManager.parallelizer_for_model(config), op.Parallelizer)


def test_unsupported_model_lists_supported_types():
    assert not op.ParallelizersManager.is_model_supported("not-a-model")
    with pytest.raises(op.UnsupportedModelError, match=r"'not-a-model' is not supported; supported: .*llama"):
        op.ParallelizersManager.parallelizer_for_model("not-a-model")


def test_register_a_custom_parallelizer():
    class Custom(op.Parallelizer):
        pass

    op.ParallelizersManager.register("my-model", Custom)
    try:
        assert op.ParallelizersManager.parallelizer_for_model("my-model") is Custom
        with pytest.raises(TypeError, match="Parallelizer subclass"):
            op.ParallelizersManager.register("bad", object)
    finally:
        op.ParallelizersManager._registry.pop("my-model")


def test_a_lookup_imports_only_its_family_and_a_hand_registration_wins():
    """Each family's module is imported when its model type is first asked for (fresh interpreter)."""
    probe = """
import sys
import optimum_parallel as op
class Custom(op.Parallelizer):
    pass
op.ParallelizersManager.register("t5", Custom)  # before the entry points are read: still wins
chosen = op.ParallelizersManager.parallelizer_for_model("llama").__name__
custom = op.ParallelizersManager.parallelizer_for_model("t5") is Custom
families = sorted(m for m in sys.modules if m.startswith("optimum_parallel.families."))
print("RESULT", chosen, custom, ",".join(families))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("RESULT"))
    assert line.split()[1:] == [
        "LlamaParallelizer",
        "True",
        "optimum_parallel.families._common,optimum_parallel.families.llama",
    ]
