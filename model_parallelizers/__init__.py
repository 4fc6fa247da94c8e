"""Deprecated: the model families moved to `optimum_parallel.families` (this alias goes in the next release)."""

import importlib
import sys
import warnings

warnings.warn(
    "`model_parallelizers` is deprecated and will be removed in the next release; "
    "import the families from `optimum_parallel.families` instead",
    DeprecationWarning,
    stacklevel=2,
)

_FAMILIES = ("_common", "bert", "gemma", "gpt2", "gpt_neo", "gpt_neox", "llama", "moe", "opt", "phi3", "qwen3", "t5")
for _name in _FAMILIES:  # `import model_parallelizers.llama` finds the moved module under its old name
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"optimum_parallel.families.{_name}")
