"""The README's benchmark tables are the committed results' (`results/*.json`, printed by scripts/readme_tables.py):
a figure changes by rerunning its benchmark with `--json`, never by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import readme_tables  # noqa: E402


def test_readme_tables_are_the_results():
    results = sorted(str(p) for p in (ROOT / "results").glob("*.json"))
    assert results, "results/*.json: no benchmark results committed"
    readme = (ROOT / "README.md").read_text()
    assert readme_tables.with_tables(readme, readme_tables.markdown(results)) == readme, (
        "README.md's benchmark tables differ from results/*.json: "
        "python scripts/bench.py tables --readme README.md results/*.json"
    )


def test_markers_are_required():
    with pytest.raises(SystemExit, match="bench-tables"):
        readme_tables.with_tables("# no markers\n", "| a |")
    text = f"before\n{readme_tables.BEGIN}\nold\n{readme_tables.END}\nafter\n"
    assert (
        readme_tables.with_tables(text, "new")
        == f"before\n{readme_tables.BEGIN}\n\nnew\n\n{readme_tables.END}\nafter\n"
    )
