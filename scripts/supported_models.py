"""Print the README's support table from a run of the family matrix (`make test-families`), not from declarations:
which layouts each model type passed against one process, which it refused and why, and the share of the
parameter elements a rank holds at tp=2.

The matrix pins what it expects (`tests/families/expected_matrix.json`: per model type and layout "equal" or
"refused: <the layer it names>", and the held share): `make test-families` fails on a cell that differs, and
`make test` fails when the README's table is not the pinned one. After a change that moves a cell on purpose:

    make test-families                                                   # writes build/family-matrix.jsonl
    python scripts/supported_models.py --results build/family-matrix.jsonl
    python scripts/supported_models.py --results build/family-matrix.jsonl --reasons   # the refusals, in full
    python scripts/supported_models.py --results build/family-matrix.jsonl --pin       # rewrite the pinned table
    python scripts/supported_models.py --readme                          # the README's table, from the pins
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


EXPECTED = Path(__file__).resolve().parent.parent / "tests" / "families" / "expected_matrix.json"


def cell_text(outcome: str, detail: str) -> str:
    """What a cell shows: "equal", "refused: <the layer it names>" or "**FAILED**"."""
    mark = MARK[outcome]
    return f"{mark}: {short_reason(detail)}" if outcome == "refused" else mark


def held_text(held: float | None) -> str:
    return f"{held:.2f}" if held is not None else "-"


def pins(cells: dict[str, dict[str, dict]]) -> dict[str, dict[str, str]]:
    """A run's cells as the pinned table: model type -> layout -> cell text, and "held" -> the share held at tp=2."""
    pinned = {}
    for model_type, by_layout in cells.items():
        row = {layout: cell_text(c["outcome"], c["detail"]) for layout, c in by_layout.items()}
        held = [c["held"] for c in by_layout.values() if c.get("held") is not None]
        row["held"] = held_text(held[0] if held else None)
        pinned[model_type] = row
    return pinned


def read_pins(path: Path = EXPECTED) -> dict[str, dict[str, str]]:
    return json.loads(path.read_text())


def table(pinned: dict[str, dict[str, str]]) -> str:
    """The README's table of a pinned table (or of a run's `pins`)."""
    lines = [
        "| model type | " + " | ".join(LAYOUTS) + " | held at tp=2 |",
        "|---|" + "---|" * len(LAYOUTS) + "---|",
    ]
    for model_type, row in pinned.items():
        cells = [row.get(layout, "-") for layout in LAYOUTS]
        lines.append(f"| `{model_type}` | " + " | ".join(cells) + f" | {row.get('held', '-')} |")
    return "\n".join(lines)


def counts_of_pins(pinned: dict[str, dict[str, str]]) -> str:
    """The line under the README's table: how many model types and cells, and how they end."""
    texts = [text for row in pinned.values() for layout, text in row.items() if layout != "held"]
    equal = sum(t == "equal" for t in texts)
    refused = sum(t.startswith("refused") for t in texts)
    return (
        f"{len(pinned)} model types, {len(texts)} cells: {equal} equal to one process, {refused} refused by name, "
        f"{len(texts) - equal - refused} failed"
    )


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
    parser.add_argument("--pin", action="store_true", help=f"write the run's cells as the pinned table ({EXPECTED})")
    parser.add_argument("--readme", action="store_true", help="print the README's table from the pinned table")
    args = parser.parse_args()
    if args.readme:
        print(table(read_pins()))
        print()
        print(counts_of_pins(read_pins()))
        return
    if not args.results.exists():
        raise SystemExit(f"{args.results} does not exist: run `make test-families` first")
    cells = read_results(args.results)
    if args.pin:
        EXPECTED.write_text(json.dumps(pins(cells), indent=1) + "\n")
        print(f"wrote {EXPECTED}")
    print(table(pins(cells)))
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
