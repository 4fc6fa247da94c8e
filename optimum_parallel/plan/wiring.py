"""Every tensor-parallel layer's wiring, decided from the whole plan before any module is built: `plan_context` returns
the `PlanContext` every style is applied with -- the model's region entry, its sequence region, and for each layer a
swapping style builds, how it enters or leaves the tp region (`comm.tp_entry.LayerWiring`), as the plan's
sequence-parallel styles imply. Design notes: docs/module_notes.md.
"""

from __future__ import annotations

from torch import nn

from ..comm.tp_entry import LayerWiring, RegionEntry, SequenceRegion, Siblings
from ..styles import ParallelStyle, PlanContext, SequenceParallelBegin, SequenceParallelDisable, SequenceParallelEnd
from ..styles.base import COLUMN, ROW
from ..styles.sequence_parallel import SequenceParallelEnable
from .wrappers import style_target

SEQUENCE_STYLES = (SequenceParallelBegin, SequenceParallelEnd, SequenceParallelEnable, SequenceParallelDisable)


def _builds(styles: list[ParallelStyle]) -> str | None:
    """COLUMN or ROW when one of `styles` builds such a layer, else None."""
    return next((s.builds for s in styles if s.swaps_module and s.builds is not None), None)


def plan_context(
    model: nn.Module, module_styles: dict[str, list[ParallelStyle]], mesh, overlap: bool = True
) -> PlanContext:
    """The context every style of `module_styles` (a checked plan) is applied with: the model's entry, its sequence
    region (when the plan has sequence-parallel styles) and every layer's wiring."""
    entry = RegionEntry()
    sequence = None
    if any(isinstance(s, SEQUENCE_STYLES) for styles in module_styles.values() for s in styles):
        sequence = SequenceRegion(mesh.tp_group)
    kinds = {name: _builds(styles) for name, styles in module_styles.items()}
    gathering = [
        name
        for name, styles in module_styles.items()
        if any(isinstance(s, SequenceParallelDisable) and not s.replicate for s in styles)
        and any(kind is not None and other.startswith(name + ".") for other, kind in kinds.items())
    ]
    ends = {name for name, styles in module_styles.items() if any(isinstance(s, SequenceParallelEnd) for s in styles)}
    modules = dict(model.named_modules())
    siblings: dict[str, Siblings] = {}
    wirings: dict[str, LayerWiring] = {}
    for name, kind in kinds.items():
        if kind is None:
            continue
        inside = any(name.startswith(block + ".") for block in gathering)
        wrapped = style_target(modules[name]) is not modules[name]  # its layer's parent is the wrapper
        family = None
        if kind == COLUMN:
            family = Siblings() if wrapped else siblings.setdefault(name.rpartition(".")[0], Siblings())
        keeps_whole = any(getattr(s, "keeps_output_whole", False) for s in module_styles[name])
        splits = (inside and not keeps_whole) if kind == ROW else (name in ends and not inside)
        wirings[name] = LayerWiring(
            entry=None if (inside and kind == COLUMN) else entry,
            sequence=sequence if splits else None,
            siblings=family,
            overlap=overlap,
        )
    return PlanContext(
        mesh,
        entry=entry,
        sequence=sequence,
        wirings=wirings,
        default_wiring=LayerWiring(entry=entry, overlap=overlap),
        gathering_blocks=frozenset(gathering),
        kinds={name: kind for name, kind in kinds.items() if kind is not None},
    )
