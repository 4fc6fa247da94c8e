"""Styles <-> JSON: a style as {"style": class name, "args": constructor arguments}, and back.

Styles are found by class name among those `optimum_parallel.styles` exports and those added with
`register_style`. A style whose arguments are not plain data (a `PrepareLayerInput` function), or that does
not rebuild to the same arguments, is written with `"reloadable": false` and refuses to be rebuilt.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

from .. import styles
from ..styles import ParallelStyle

STYLES: dict[str, type[ParallelStyle]] = {
    name: obj
    for name, obj in vars(styles).items()
    if isinstance(obj, type) and issubclass(obj, ParallelStyle) and obj is not ParallelStyle
}


def register_style(cls: type[ParallelStyle]) -> type[ParallelStyle]:
    """Make a custom style class (plain-data constructor arguments) savable and loadable by its class name."""
    if not (isinstance(cls, type) and issubclass(cls, ParallelStyle)):
        raise TypeError(f"register_style needs a ParallelStyle subclass, got {cls!r}")
    STYLES[cls.__name__] = cls
    return cls


def _plain(value: object) -> object:
    """`value` as JSON data (tuples become lists); raises TypeError for anything else."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    raise TypeError(type(value).__name__)


def style_to_dict(style: ParallelStyle) -> dict:
    """{"style": class name, "args": constructor arguments}; not reloadable when an argument is not plain data."""
    name = type(style).__name__
    try:
        args = {key: _plain(value) for key, value in vars(style).items()}
    except TypeError:
        args = {key: repr(value) for key, value in vars(style).items()}
        return {"style": name, "args": args, "reloadable": False}
    if STYLES.get(name) is not type(style):
        return {"style": name, "args": args, "reloadable": False}
    try:
        rebuilt = style_from_dict({"style": name, "args": args}, "")
        same = {k: _plain(v) for k, v in vars(rebuilt).items()} == args
    except (TypeError, ValueError):
        same = False
    return {"style": name, "args": args} if same else {"style": name, "args": args, "reloadable": False}


def style_from_dict(entry: Mapping, where: str) -> ParallelStyle:
    """The style an entry of `modules` describes; `where` names the entry in errors."""
    name = entry.get("style")
    if entry.get("reloadable", True) is False:
        raise ValueError(
            f"plan file entry {where}: style {name} was saved with arguments that are not plain data "
            f"({entry.get('args')}); it cannot be rebuilt from a file: add it to the loaded plan by hand, "
            "or load with skip_unreloadable=True"
        )
    cls = STYLES.get(name)
    if cls is None:
        raise ValueError(
            f"plan file entry {where}: unknown style {name!r}; known: {', '.join(sorted(STYLES))} "
            "(register custom ones with optimum_parallel.memory_planner.plan_files.register_style)"
        )
    args = dict(entry.get("args") or {})
    accepted = inspect.signature(cls.__init__).parameters
    call = {k: v for k, v in args.items() if k in accepted}
    try:
        style = cls(**call)
    except (TypeError, ValueError) as err:
        raise ValueError(f"plan file entry {where}: {name}(**{call}) failed: {err}") from None
    for key, value in args.items():  # attributes the constructor does not take (ColWiseConv1D's parts=1)
        if key not in call and _plain(getattr(style, key, None)) != value:
            raise ValueError(f"plan file entry {where}: {name} cannot be rebuilt with {key}={value!r}")
    return style
