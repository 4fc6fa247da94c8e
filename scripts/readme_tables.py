"""The README's benchmark tables (markdown) from `scripts/bench.py NAME --json` results.

    python scripts/readme_tables.py results/*.json     # or: python scripts/bench.py tables results/*.json

Per file: a heading with the benchmark, when and where it ran (torch, transformers, CPUs, load average) and its
arguments, then each table it printed, cell for cell, and the rows it recorded outside a table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _common import markdown_lines


def tables_of(document: dict) -> list[str]:
    """The markdown of one result document."""
    env = document.get("environment", {})
    load = env.get("load_average") or []
    lines = [
        f"### {document['benchmark']}",
        "",
        f"{env.get('date', '?')}, git {env.get('git') or '?'}: torch {env.get('torch')}, transformers "
        f"{env.get('transformers')}, {env.get('cpus')} CPUs, load average {'/'.join(f'{x:.1f}' for x in load)}; "
        f"arguments: {' '.join(document.get('argv', [])) or '(defaults)'}",
    ]
    for spec in document.get("tables", []):
        rows = [r for r in document["rows"] if r["table"] == spec["name"]]
        lines += ["", spec["name"], "", *markdown_lines(spec["columns"], table_body(spec, rows), align_numbers=True)]
    return lines


def table_body(spec: dict, rows: list[dict]) -> list[list[str]]:
    """The cells of one table: a printed row's in the order they were recorded (one per column after the first,
    whatever the columns' names: two may share one, "cp=2" under two models), a recorded variant's by metric."""
    body: dict[tuple, list[str]] = {}
    for r in rows:
        if r.get("row") is not None:  # a printed row: its cells in column order
            body.setdefault((r["row"], r["variant"]), [r["variant"]]).append(r["text"])
        else:  # `record`ed: one cell per metric, where its column is
            cells = body.setdefault((None, r["variant"]), [r["variant"], *([""] * (len(spec["columns"]) - 1))])
            cells[spec["columns"].index(r["metric"])] = r["text"]
    return list(body.values())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="JSON files written by scripts/bench.py NAME --json")
    args = parser.parse_args(argv)
    out: list[str] = []
    for path in args.results:
        document = json.loads(Path(path).read_text())
        if document.get("schema") != 1:
            raise SystemExit(f"{path}: not a scripts/bench.py result (schema 1)")
        out += [*([""] if out else []), *tables_of(document)]
    print("\n".join(out))


if __name__ == "__main__":
    main()
