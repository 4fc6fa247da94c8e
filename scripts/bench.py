"""The one entry point of the benchmarks: runs scripts/bench_NAME.py's main with the benchmark's own arguments and,
with --json, writes what it reported in the one result schema (scripts/_common.py: results_document).

    python scripts/bench.py --list                              # every benchmark, one line each
    python scripts/bench.py tp --json results/tp.json --steps 3  # bench_tp.py with its own arguments
    python scripts/bench.py tables results/*.json               # the README's tables back from the JSON results
    python scripts/bench.py NAME --help                         # the benchmark's own arguments

`python scripts/bench_NAME.py ...` still runs the same benchmark, without --json.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent


def benchmarks() -> dict[str, str]:
    """NAME -> the first line of bench_NAME.py's docstring (read without importing it)."""
    found = {}
    for path in sorted(SCRIPTS.glob("bench_*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        found[path.stem.removeprefix("bench_")] = doc.strip().splitlines()[0] if doc.strip() else ""
    return found


def run(name: str, json_path: str | None, rest: list[str]) -> None:
    """bench_NAME's main() on `rest`; its parsed arguments and recorded rows written to `json_path`."""
    sys.path.insert(0, str(SCRIPTS))
    import _common

    module = importlib.import_module(f"bench_{name}")
    _common.RESULTS.benchmark = name
    parse_args = argparse.ArgumentParser.parse_args

    def recording_parse_args(parser, args=None, namespace=None):  # the benchmark's config: its parsed arguments
        parsed = parse_args(parser, args, namespace)
        if not _common.RESULTS.config:
            _common.RESULTS.config = {k: v for k, v in vars(parsed).items() if not k.startswith("_")}
        return parsed

    argparse.ArgumentParser.parse_args = recording_parse_args
    sys.argv = [str(SCRIPTS / f"bench_{name}.py"), *rest]
    try:
        module.main()
    finally:
        argparse.ArgumentParser.parse_args = parse_args
    if json_path:
        document = _common.results_document(rest)
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(document, indent=1, default=str) + "\n")
        print(f"{len(document['rows'])} result rows written to {json_path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    known = benchmarks()
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\nbenchmarks: " + ", ".join(known))
        return
    if argv[0] == "--list":
        width = max(map(len, known))
        for name, line in known.items():
            print(f"{name:{width}}  {line}")
        return
    if argv[0] == "tables":
        sys.path.insert(0, str(SCRIPTS))
        import readme_tables

        readme_tables.main(argv[1:])
        return
    name, rest = argv[0], argv[1:]
    if name not in known:
        sys.exit(f"bench.py: no benchmark {name!r}; one of: {', '.join(known)} (or --list, tables)")
    json_path = None
    if "--json" in rest:  # ours, not the benchmark's: taken out before its parser sees the arguments
        at = rest.index("--json")
        if at + 1 >= len(rest):
            sys.exit("bench.py: --json needs a file name")
        json_path, rest = rest[at + 1], rest[:at] + rest[at + 2 :]
    run(name, json_path, rest)


if __name__ == "__main__":
    main()
