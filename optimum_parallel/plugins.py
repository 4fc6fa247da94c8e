"""Entry points of this package's plugin groups (parallelizers, wrapper handlers), read from the installed
distributions' metadata once per process: each scan cost 4-8 ms here, and a first load reads two groups."""

from __future__ import annotations

from functools import cache
from importlib.metadata import EntryPoints, entry_points


@cache
def _every_entry_point() -> EntryPoints:
    return entry_points()


def plugin_entry_points(group: str) -> EntryPoints:
    """The entry points of `group` (as `importlib.metadata.entry_points(group=group)`)."""
    return _every_entry_point().select(group=group)
