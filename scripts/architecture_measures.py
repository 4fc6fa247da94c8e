"""Measures of the package's structure (issue 32), printed as a table: what one must read to understand a
column-parallel linear, and the package's files and lines. The import arrows and the import circles (this script's
count until issue 43) are checked by import-linter's contracts in `make lint` (pyproject.toml [tool.importlinter]).

    python scripts/architecture_measures.py [PACKAGE_DIR]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import grimp

ROOT = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "optimum_parallel"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def graph() -> dict[str, set[str]]:
    """{module: package modules it imports (module level and inside functions)}, annotation-only imports left out:
    import-linter's graph (grimp), the one `make lint` checks the arrows and the import circles on."""
    sys.path.insert(0, str(ROOT.parent))
    imports = grimp.build_graph(ROOT.name, exclude_type_checking_imports=True, cache_dir=None)
    return {
        name: {t for t in imports.find_modules_directly_imported_by(name) if not name.startswith(t + ".")}
        for name in imports.modules
    }


LAYER_ATTRIBUTES = r"\.(sequence_parallel|enter_region|overlap_weight_grads|_entry_siblings)\s*=[^=]"
DECIDES = r"(?<![A-Za-z_])LayerWiring\((?!\))"  # a mode made with arguments: a decision, not a constructor default
SUPPORT = {"comm.shared_memory", "tensor_parallel.spec"}  # a transport (same results as torch's) and shape bookkeeping


def _path(module: str) -> Path:
    return ROOT.parent.joinpath(*module.split(".")).with_suffix(".py")


def column_linear_reading(edges: dict[str, set[str]]) -> tuple[list[str], int]:
    """The files one reads to know what a column-parallel linear does in a forward and backward: the one defining it,
    the package modules it runs (its imports, transitively, inside comm/ and tensor_parallel/; not `SUPPORT`), and
    every other module that decides its mode (makes a `LayerWiring` with arguments) or sets one of its mode attributes
    after it is built."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    start = next(m for m, p in modules.items() if "class ColumnParallelLinear" in p.read_text())
    seen, todo = {start}, [start]
    while todo:
        for w in edges.get(todo.pop(), ()):
            room = w.split(".")[1] if "." in w else ""
            support = {f"{ROOT.name}.{m}" for m in SUPPORT}
            package = ROOT.joinpath(*w.split(".")[1:], "__init__.py").exists()  # a room's public surface
            if room in ("comm", "tensor_parallel") and w not in seen | support and not package:
                seen.add(w)
                todo.append(w)
    for name, path in modules.items():
        text = path.read_text()
        if re.search(DECIDES, text) or (re.search(LAYER_ATTRIBUTES, text) and "ColumnParallelLinear" in text):
            seen.add(name)
    files = sorted(seen)
    return files, sum(len(_path(m).read_text().splitlines()) for m in files if _path(m).exists())


if __name__ == "__main__":
    files, lines = column_linear_reading(graph())
    print(f"{'measure':<52} | value")
    print("-" * 53 + "+" + "-" * 30)
    print(f"{'files to read for a column-parallel linear':<52} | {len(files)} ({lines} lines)")
    for name in files:
        print(f"{'':<52} |   {name.split('.', 1)[1]}")
    paths = list(ROOT.rglob("*.py"))
    total = sum(len(p.read_text().splitlines()) for p in paths)
    print(f"{'python files / lines in the package':<52} | {len(paths)} / {total}")
