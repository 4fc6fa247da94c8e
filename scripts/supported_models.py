"""Print the README's support table from a run of the family matrix (`make test-families`), not from declarations:
which layouts each model type passed against one process, which it refused and why, and the share of the
parameter elements a rank holds at tp=2.

    make test-families                                                   # writes build/family-matrix.jsonl
    python scripts/supported_models.py --results build/family-matrix.jsonl
    python scripts/supported_models.py --results build/family-matrix.jsonl --reasons   # the refusals, in full
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

LAYOUTS = ("tp2+sp", "pp2", "cp2", "ep2", "tp2xdp2-L3")
MARK = {"equal": "equal", "refused": "refused", "FAILED": "**FAILED**"}


def read_results(path: Path) -> dict[str, dict[str, dict]]:
    """model type -> layout -> its cell (outcome, detail, held), the last line of a cell winning."""
    cells: dict[str, dict[str, dict]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            cell = json.loads(line)
            cells.setdefault(cell["type"], {})[cell["layout"]] = cell
    return cells


def short_reason(detail: str) -> str:
    """The module a refusal names (`model.layers.0.mamba (JambaMambaMixer)`), else its first clause."""
    found = re.search(r"(model\.[\w.]+ \(\w+\))", detail)
    if found:
        return found.group(1)
    text = detail.split(": ", 1)[-1].split(";")[0]
    return text if len(text) <= 80 else text[:80].rpartition(" ")[0] + " ..."


def table(cells: dict[str, dict[str, dict]]) -> str:
    lines = [
        "| model type | " + " | ".join(LAYOUTS) + " | held at tp=2 |",
        "|---|" + "---|" * len(LAYOUTS) + "---|",
    ]
    for model_type, by_layout in cells.items():
        row, held = [], None
        for layout in LAYOUTS:
            cell = by_layout.get(layout)
            if cell is None:
                row.append("-")
                continue
            held = held if cell.get("held") is None else cell["held"]
            mark = MARK[cell["outcome"]]
            row.append(f"{mark}: {short_reason(cell['detail'])}" if cell["outcome"] == "refused" else mark)
        held_text = f"{held:.2f}" if held is not None else "-"
        lines.append(f"| `{model_type}` | " + " | ".join(row) + f" | {held_text} |")
    return "\n".join(lines)


def counts(cells: dict[str, dict[str, dict]]) -> str:
    outcomes = [cell["outcome"] for by_layout in cells.values() for cell in by_layout.values()]
    return (
        f"{len(cells)} model types, {len(outcomes)} cells: {outcomes.count('equal')} equal to one process, "
        f"{outcomes.count('refused')} refused by name, {outcomes.count('FAILED')} failed"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("build/family-matrix.jsonl"))
    parser.add_argument("--reasons", action="store_true", help="list every refusal's message in full")
    args = parser.parse_args()
    if not args.results.exists():
        raise SystemExit(f"{args.results} does not exist: run `make test-families` first")
    cells = read_results(args.results)
    print(table(cells))
    print()
    print(counts(cells))
    if args.reasons:
        print()
        for model_type, by_layout in cells.items():
            for layout, cell in by_layout.items():
                if cell["outcome"] != "equal":
                    print(f"- `{model_type}` {layout}: {cell['detail']}")


if __name__ == "__main__":
    main()
