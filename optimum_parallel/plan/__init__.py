"""Plans: regex -> style dicts, resolved against a model, checked, then applied."""

from .apply import apply_plan, check_plan, parallel_layouts, resolve_plan
from .caller_outputs import logits_mode

__all__ = ["apply_plan", "check_plan", "logits_mode", "parallel_layouts", "resolve_plan"]
