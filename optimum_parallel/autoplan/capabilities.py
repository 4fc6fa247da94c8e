"""What a model supports beyond tensor parallelism: declared by a hand-written family (`Parallelizer.capabilities`),
derived from the model's structure otherwise (`autoplan/structure.py`); resolved once per request by `validate` and
passed down, never looked up in a list of model types.
"""

from __future__ import annotations

from dataclasses import dataclass

LLAMA_ACTIVATIONS = "llama"  # RMSNorm, SwiGLU, no dropout: the planner's Llama activation count applies


@dataclass(frozen=True)
class Capabilities:
    """`sequence_parallel`: the plan honours sequence_parallel_enabled; `pipeline_parallel`: the decoder splits into
    pipeline stages; `context_parallel`: every cross-token computation is attention through transformers'
    AttentionInterface that the context-parallel attention computes; `activations`: the planner's activation formula
    (`LLAMA_ACTIVATIONS`, or None when the planner has none for it); `refusals`: (layout, why) for the layouts a
    model's structure refuses ('sequence', 'pipeline', 'context'), naming the module and layer that block each."""

    sequence_parallel: bool = False
    pipeline_parallel: bool = False
    context_parallel: bool = False
    activations: str | None = None
    refusals: tuple[tuple[str, str], ...] = ()

    def reason(self, layout: str) -> str | None:
        """Why `layout` ('sequence', 'pipeline', 'context') is refused, where the structure said (None: not known)."""
        return next((why for name, why in self.refusals if name == layout), None)


NONE = Capabilities()
