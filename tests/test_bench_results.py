"""The benchmarks' result schema end to end, without a benchmark: a fake table printed and a row recorded through
scripts/_common.py (`print_table`, `record`), written as JSON by scripts/bench.py (`run`, as `--json` does), and read
back as markdown by scripts/readme_tables.py, cell for cell."""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import _common  # noqa: E402
import bench  # noqa: E402
import readme_tables  # noqa: E402

HEADER = ("variant", "median ms", "peak", "note")
ROWS = [
    ("eager", "12.02 (0.94x)", "3.2 GiB", "ok"),
    ("compiled", "1,024", "-", "n/a"),
]
SHARED = ("tokens", "a ms cp=1", "cp=2", "b ms cp=1", "cp=2")  # two columns of one name: printed back in place
SHARED_ROWS = [("512", "538", "768", "214", "1101")]


def fake_main() -> None:
    """What a benchmark's main does: parse its arguments, print a table, record a figure outside it."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    _common.print_table(HEADER, ROWS, align_numbers=True, title="fake steps")
    _common.record("load", "time", 1.5, "s", table="fake load")
    _common.print_table(SHARED, SHARED_ROWS, align_numbers=True, title="shared names")
    assert args.steps == 2


@pytest.fixture
def results(monkeypatch):
    """A fresh `_common.RESULTS` and a fake `bench_fake` module for `bench.run` to import."""
    monkeypatch.setattr(_common, "RESULTS", _common.Results())
    monkeypatch.setitem(sys.modules, "bench_fake", types.SimpleNamespace(main=fake_main))
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # bench.run sets the benchmark's argv
    return _common.RESULTS


def test_parse_cell():
    assert _common.parse_cell("12.02 (0.94x)", "median ms") == (12.02, "ms", 0.94)
    assert _common.parse_cell("3.2 GiB", "peak") == (3.2, "GiB", None)
    assert _common.parse_cell("1,024", "step (seconds)") == (1024.0, "s", None)
    assert _common.parse_cell("-", "median ms") == (None, "", None)
    assert _common.parse_cell("over by 0.4", "verdict") == (None, "", None)


def test_round_trip(results, tmp_path, capsys):
    out = tmp_path / "fake.json"
    bench.run("fake", str(out), ["--steps", "2"])
    printed = capsys.readouterr().out.splitlines()
    document = json.loads(out.read_text())

    assert document["schema"] == 1 and document["benchmark"] == "fake"
    assert document["config"] == {"steps": 2} and document["argv"] == ["--steps", "2"]
    assert {"torch", "transformers", "python", "cpus", "date", "git"} <= set(document["environment"])
    assert document["tables"] == [
        {"name": "fake steps", "columns": list(HEADER)},
        {"name": "fake load", "columns": ["", "time"]},
        {"name": "shared names", "columns": list(SHARED)},
    ]
    assert len(document["rows"]) == 2 * 3 + 1 + 4
    rows = {(r["table"], r["variant"], r["metric"]): r for r in document["rows"] if r["table"] != "shared names"}
    eager = rows["fake steps", "eager", "median ms"]
    assert (eager["row"], eager["value"], eager["unit"], eager["ratio_to"], eager["text"]) == (
        0, 12.02, "ms", 0.94, "12.02 (0.94x)"
    )  # fmt: skip
    peak, compiled = rows["fake steps", "eager", "peak"], rows["fake steps", "compiled", "peak"]
    assert (peak["value"], peak["unit"]) == (3.2, "GiB") and (compiled["value"], compiled["row"]) == (None, 1)
    assert rows["fake steps", "compiled", "median ms"]["value"] == 1024.0
    load = rows["fake load", "load", "time"]
    assert "row" not in load and (load["value"], load["unit"], load["text"]) == (1.5, "s", "1.5")

    readme_tables.main([str(out)])
    markdown = capsys.readouterr().out.splitlines()
    assert markdown[0] == "### fake" and "`python scripts/bench.py fake --steps 2`" in markdown[2]
    table = _common.markdown_lines(HEADER, ROWS, align_numbers=True)
    shared = _common.markdown_lines(SHARED, SHARED_ROWS, align_numbers=True)
    assert [line for line in printed if line.startswith("|")] == table + shared  # what the benchmark printed
    at = markdown.index("*fake steps*")
    assert markdown[at + 2 : at + 2 + len(table)] == table  # the same table, cell for cell, back from the JSON
    at = markdown.index("*fake load*")
    load = _common.markdown_lines(["", "time"], [["load", "1.5"]], align_numbers=True)
    assert markdown[at + 2 : at + 2 + len(load)] == load
    at = markdown.index("*shared names*")
    assert markdown[at + 2 :] == shared


def test_not_a_result(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"settings": {}, "results": {}}))
    with pytest.raises(SystemExit, match="schema 1"):
        readme_tables.main([str(path)])


def test_single_gpu_lane_table(results, tmp_path, capsys):
    """bench_single_gpu's table (here --lane-only's, from a JUnit file) goes through `print_table` into the JSON;
    the lines scripts/device_check.sh relies on (the summary) and the exit status stay."""
    junit = tmp_path / "lane.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase name="test_a"/><testcase name="test_b"><failure message="boom"/>'
        "</testcase></testsuite></testsuites>"
    )
    out = tmp_path / "single_gpu.json"
    bench.run("single_gpu", str(out), ["--lane-only", "--junit", f"lane={junit}"])
    printed = capsys.readouterr().out.splitlines()
    document = json.loads(out.read_text())

    import bench_single_gpu

    assert document["tables"] == [{"name": "accelerator lane", "columns": list(bench_single_gpu.HEADER)}]
    cells = {(r["row"], r["metric"]): r["text"] for r in document["rows"]}
    assert cells[0, "result"] == "1 passed, 1 failed" and cells[1, "result"] == "boom"
    assert [r["variant"] for r in document["rows"] if r["metric"] == "result"] == ["lane: lane", "  FAILED test_b"]
    assert printed[-1] == "FAILED: lane: lane; FAILED test_b"
    assert len([line for line in printed if line.startswith("|")]) == 2 + 2
    sys.argv = ["bench_single_gpu.py", "--lane-only", "--junit", f"lane={junit}"]
    assert bench_single_gpu.main() == 1


def test_memory_tables_titled(results):
    """bench_memory's tables are recorded under their printed titles."""
    import bench_memory

    bench_memory.print_titled("Table 9: fake", ("level", "params between steps"), [("0", "0.16 (1.00x)")])
    assert results.tables == [{"name": "Table 9: fake", "columns": ["level", "params between steps"]}]
    row = results.rows[0]
    assert (row["table"], row["variant"], row["value"], row["ratio_to"]) == ("Table 9: fake", "0", 0.16, 1.0)
