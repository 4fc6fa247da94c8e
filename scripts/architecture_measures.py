"""Measures of the package's structure (issues 32 and 43) for one git revision's tree, printed as a table (or JSON):
compose's lines and the package files it calls into, attributes set on an object after it is built, vulture's
findings, the import-linter contracts, duplicate pairs, the package's files and lines, and its names and words
(issue 50): module docstrings' lengths, comments that trail a code line, file names used in two folders, private
metaphors, and the benchmarks that time on their own clock.

    python scripts/architecture_measures.py [--rev REV] [--json]

With --rev the tree is exported (`git archive REV | tar -x`) to a temp dir and measured there; without, the working
tree is measured.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import tempfile
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PACKAGE = "optimum_parallel"
COMPOSE = ("compose", "compose_model", "compose_training")
CONSTRUCTORS = {"__init__", "__post_init__", "__new__", "__setstate__"}


def export(rev: str, into: Path) -> Path:
    """The tree of `rev`, written below `into`."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def package_files(root: Path) -> list[Path]:
    return sorted((root / PACKAGE).rglob("*.py"))


def imported_modules(tree: ast.Module, module: str) -> dict[str, str]:
    """{local name: the module it comes from} for every import in the module (any depth), relative ones resolved."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom):
            base = module.split(".")[: -node.level] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                names[alias.asname or alias.name] = f"{source}.{alias.name}"  # the module file is found by trimming
    return names


def module_file(root: Path, dotted: str) -> str | None:
    """The package file that defines `dotted` (a module, or a name inside one; a package's re-export followed to
    the module it comes from), relative to root."""
    parts = dotted.split(".")
    while parts and parts[0] == PACKAGE:
        if root.joinpath(*parts).with_suffix(".py").exists():
            return str(root.joinpath(*parts).with_suffix(".py").relative_to(root))
        init = root.joinpath(*parts, "__init__.py")
        if init.exists():
            rest = dotted.split(".")[len(parts) :]
            exported = imported_modules(ast.parse(init.read_text()), ".".join(parts) + ".__init__")
            if rest and rest[0] in exported and exported[rest[0]] != dotted:  # a re-export: the defining module
                return module_file(root, ".".join([exported[rest[0]], *rest[1:]])) or str(init.relative_to(root))
            return str(init.relative_to(root))
        parts = parts[:-1]
    return None


def compose_measures(root: Path) -> dict:
    """Lines of each compose function and the distinct package files their bodies call into (through the imports),
    following the calls into compose.py's own helper functions (their calls count as compose's)."""
    path = root / PACKAGE / "engine" / "compose.py"
    if not path.exists():
        return {"lines": {}, "files_called": None}
    tree = ast.parse(path.read_text())
    imports = imported_modules(tree, f"{PACKAGE}.engine.compose")
    local = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    lines = {name: local[name].end_lineno - local[name].lineno + 1 for name in COMPOSE if name in local}
    called: set[str] = set()
    todo, seen = [name for name in COMPOSE if name in local], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for call in (n for n in ast.walk(local[name]) if isinstance(n, ast.Call)):
            head, chain = call.func, []
            while isinstance(head, ast.Attribute):
                chain.insert(0, head.attr)
                head = head.value
            if isinstance(head, ast.Name) and head.id in local and not chain:
                todo.append(head.id)
            elif isinstance(head, ast.Name) and head.id in imports:
                target = module_file(root, ".".join([imports[head.id], *chain]))
                if target:
                    called.add(target)
    lines["total"] = sum(lines.values())
    return {"lines": lines, "files_called": sorted(called)}


class _LateAttributes(ast.NodeVisitor):
    """Counts attribute writes by the nearest enclosing function (module level counts as (a))."""

    def __init__(self) -> None:
        self.outside, self.self_late, self.functions = 0, 0, [None]

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.functions.append(node)
        self.generic_visit(node)
        self.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def _target(self, target: ast.expr) -> None:
        func = self.functions[-1]
        first = func.args.args[0].arg if func and func.args.args else None
        if isinstance(target, ast.Tuple):
            for element in target.elts:
                self._target(element)
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
            if target.value.id in ("self", "cls") and target.value.id == first:
                self.self_late += func.name not in CONSTRUCTORS
            else:
                self.outside += 1
        elif isinstance(target, ast.Attribute):
            self.outside += 1  # a.b.c = ...: set on a.b
        elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute):
            self.outside += target.value.attr == "__dict__"

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._target(target)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign | ast.AnnAssign) -> None:
        self._target(node.target)
        self.generic_visit(node)

    visit_AnnAssign = visit_AugAssign

    def visit_Call(self, node: ast.Call) -> None:
        self.outside += isinstance(node.func, ast.Name) and node.func.id == "setattr"
        self.generic_visit(node)


def late_attributes(root: Path) -> dict:
    """(a) `obj.attr = / += ...` on an object other than self/cls (at any level), `setattr(...)` calls and
    `x.__dict__[...] = ...` writes; (b) `self.attr = ...` in a method other than the constructors."""
    counter = _LateAttributes()
    for path in package_files(root):
        counter.visit(ast.parse(path.read_text()))
    return {
        "outside_objects": counter.outside,
        "self_after_init": counter.self_late,
        "total": counter.outside + counter.self_late,
    }


def run(command: list[str], cwd: Path) -> str:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    return done.stdout + done.stderr


def vulture_findings(root: Path) -> int:
    """vulture at 80% over the package (and the whitelist, where the revision has one)."""
    whitelist = [str(w) for w in [root / "scripts" / "vulture_whitelist.py"] if w.exists()]
    out = run([str(BIN / "vulture"), "--min-confidence", "80", PACKAGE, *whitelist], root)
    return sum(1 for line in out.splitlines() if re.search(r"\(\d+% confidence", line))


def import_contracts(root: Path) -> str:
    """import-linter's verdict with the revision's pyproject: `K kept, B broken`, or `no contract`."""
    if "[tool.importlinter]" not in (root / "pyproject.toml").read_text():
        return "no contract"
    out = run([str(BIN / "lint-imports"), "--no-cache"], root)
    match = re.search(r"Contracts: (\d+) kept, (\d+) broken", out)
    return f"{match[1]} kept, {match[2]} broken" if match else "error: " + out.strip().splitlines()[-1]


def duplicate_pairs(root: Path, folder: str) -> int:
    """The pairs the `duplicates` command counts in one folder."""
    out = run(["duplicates", "--repo", folder, "--most", "1", "--seconds", "120"], root)
    match = re.match(r"(\d+) pairs?", out)
    return int(match[1]) if match else 0


METAPHORS = re.compile(r"\b(rooms?|doors?|habits?|settled?|settles)\b|# stays:", re.IGNORECASE)
WORDS_IN = (PACKAGE, "docs", "scripts", "tests", "README.md")


def docstring_measures(root: Path) -> dict:
    """The longest module docstring (lines, file) and how many are over 10 lines."""
    lengths = []
    for path in package_files(root):
        text = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        lengths.append((len(text.splitlines()) if text else 0, str(path.relative_to(root))))
    return {"longest": max(lengths), "over_10_lines": sum(n > 10 for n, _ in lengths)}


def trailing_comment_share(root: Path) -> float:
    """The share of the package's comments that trail a code line (`x = 1  # ...`)."""
    trailing = total = 0
    for path in package_files(root):
        with path.open("rb") as f:
            code_rows = set()
            for token in tokenize.tokenize(f.readline):
                if token.type == tokenize.COMMENT:
                    total += 1
                    trailing += token.start[0] in code_rows
                elif token.type not in (
                    tokenize.NL,
                    tokenize.NEWLINE,
                    tokenize.INDENT,
                    tokenize.DEDENT,
                    tokenize.ENCODING,
                    tokenize.ENDMARKER,
                ):
                    code_rows.update(range(token.start[0], token.end[0] + 1))
    return round(trailing / max(total, 1), 3)


def reused_file_names(root: Path) -> list[str]:
    """File names (other than __init__.py) that two or more of the package's folders use."""
    folders: dict[str, set[str]] = {}
    for path in package_files(root):
        folders.setdefault(path.name, set()).add(str(path.parent))
    return sorted(name for name, where in folders.items() if len(where) > 1 and name != "__init__.py")


def metaphor_lines(root: Path) -> int:
    """Lines in the package, docs, scripts, tests and README that use a private metaphor (rooms, doors, habits,
    settle, '# stays:')."""
    paths = [p for name in WORDS_IN for p in ([root / name] if name.endswith(".md") else (root / name).rglob("*"))]
    return sum(
        bool(METAPHORS.search(line))
        for p in paths
        if p.is_file() and p.suffix in (".py", ".md") and p.name != Path(__file__).name
        for line in p.read_text().splitlines()
    )


def benchmark_measures(root: Path) -> dict:
    """The bench_*.py scripts, those timing on their own `perf_counter` and those printing tables outside
    `_common.print_table` (their figures missing from `--json`)."""
    scripts = sorted((root / "scripts").glob("bench_*.py"))
    texts = {p.name: p.read_text() for p in scripts}
    return {
        "scripts": len(scripts),
        "own_clock": sorted(n for n, t in texts.items() if "perf_counter" in t),
        "tables_outside_schema": sorted(n for n, t in texts.items() if re.search(r"^def print_table", t, re.M)),
        "readme_from_results": "<!-- bench-tables" in (root / "README.md").read_text(),
    }


def measure(root: Path) -> dict:
    files = package_files(root)
    return {
        "compose": compose_measures(root),
        "late_attributes": late_attributes(root),
        "vulture_80": vulture_findings(root),
        "import_contracts": import_contracts(root),
        "duplicates": {d: duplicate_pairs(root, d) for d in (PACKAGE, "scripts")},
        "package": {"files": len(files), "lines": sum(len(p.read_text().splitlines()) for p in files)},
        "docstrings": docstring_measures(root),
        "trailing_comment_share": trailing_comment_share(root),
        "reused_file_names": reused_file_names(root),
        "metaphor_lines": metaphor_lines(root),
        "benchmarks": benchmark_measures(root),
    }


def table(rev: str, m: dict) -> str:
    compose, late = m["compose"], m["late_attributes"]
    rows = [(f"compose lines: {name}", n) for name, n in compose["lines"].items()] or [("compose", "absent")]
    called = compose["files_called"]
    rows += [
        ("package files compose calls into", "-" if called is None else f"{len(called)}: {', '.join(called)}"),
        ("attributes set later: (a) on other objects", late["outside_objects"]),
        ("attributes set later: (b) self outside constructors", late["self_after_init"]),
        ("attributes set later: (a) + (b)", late["total"]),
        ("vulture --min-confidence 80 findings", m["vulture_80"]),
        ("import-linter contracts", m["import_contracts"]),
        *((f"duplicates pairs in {d}/", n) for d, n in m["duplicates"].items()),
        (f"{PACKAGE}/ python files / lines", f"{m['package']['files']} / {m['package']['lines']}"),
        ("module docstring: longest (lines, file)", "{} ({})".format(*m["docstrings"]["longest"])),
        ("module docstrings over 10 lines", m["docstrings"]["over_10_lines"]),
        ("comments trailing a code line", f"{m['trailing_comment_share']:.0%}"),
        ("file names in two folders", f"{len(m['reused_file_names'])}: {', '.join(m['reused_file_names'])}"),
        ("lines with a private metaphor", m["metaphor_lines"]),
        ("bench_*.py scripts", m["benchmarks"]["scripts"]),
        ("  timing on their own perf_counter", ", ".join(m["benchmarks"]["own_clock"]) or "none"),
        ("  tables outside the result schema", ", ".join(m["benchmarks"]["tables_outside_schema"]) or "none"),
        ("README's benchmark tables from results", "yes" if m["benchmarks"]["readme_from_results"] else "no"),
    ]
    head = f"{'measure (' + rev + ')':<54} | value\n" + "-" * 55 + "+" + "-" * 30
    return "\n".join([head, *(f"{name:<54} | {value}" for name, value in rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="a git revision (default: the working tree)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = export(args.rev, Path(tmp)) if args.rev else REPO
        result = measure(root)
    print(json.dumps(result, indent=2) if args.json else table(args.rev or "working tree", result))


if __name__ == "__main__":
    main()
