"""Plain-text tables and sizes for the planning reports."""

from __future__ import annotations

import math


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def table(header: list[str], rows: list[list[str]], align_numbers: bool = False) -> list[str]:
    """Columns padded to their widest cell; with `align_numbers`, every column but the first is right-aligned."""
    rows = [[str(c) for c in row] for row in rows]
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]
    lines = []
    for row in [header, ["-" * w for w in widths], *rows]:
        cells = [
            c.rjust(w) if align_numbers and i > 0 else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return lines
