"""Measures of the package's structure (issue 32), printed as a table: import circles between modules (every import
but annotation-only ones), what one must read to understand a column-parallel linear, and files per room.

    python scripts/architecture_measures.py [PACKAGE_DIR]
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "optimum_parallel"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Package modules `path` imports (module level and inside functions), annotation-only imports left out."""
    tree = ast.parse(path.read_text())
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    typing_only = {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING"
        for child in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            candidates = [f"{module}.{a.name}" for a in node.names] + [module]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        for name in candidates:
            if name.startswith(ROOT.name):
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        targets = set()
        for imported in imports(path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):  # a package's own __init__
                targets.add(imported)
        edges[name] = targets
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), package __init__ re-exports left out."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w.endswith("__init__") or ROOT.joinpath(*w.split(".")[1:], "__init__.py").exists():
                continue  # importing a room's public surface is not a circle between rooms' modules
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in list(edges):
        if v not in index:
            visit(v)
    return out


LAYER_ATTRIBUTES = r"\.(sequence_parallel|enter_region|overlap_weight_grads|_entry_siblings)\s*=[^=]"
DECIDES = r"(?<![A-Za-z_])LayerMode\((?!\))"  # a mode made with arguments: a decision, not a constructor default
SUPPORT = {"comm.shared_memory", "tensor_parallel.spec"}  # a transport (same results as torch's) and shape bookkeeping


def _path(module: str) -> Path:
    return ROOT.parent.joinpath(*module.split(".")).with_suffix(".py")


def column_linear_reading(edges: dict[str, set[str]]) -> tuple[list[str], int]:
    """The files one reads to know what a column-parallel linear does in a forward and backward: the one defining it,
    the package modules it runs (its imports, transitively, inside comm/ and tensor_parallel/; not `SUPPORT`), and
    every other module that decides its mode (makes a `LayerMode` with arguments) or sets one of its mode attributes
    after it is built."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    start = next(m for m, p in modules.items() if "class ColumnParallelLinear" in p.read_text())
    seen, todo = {start}, [start]
    while todo:
        for w in edges.get(todo.pop(), ()):
            room = w.split(".")[1] if "." in w else ""
            support = {f"{ROOT.name}.{m}" for m in SUPPORT}
            if room in ("comm", "tensor_parallel") and w not in seen | support and not w.endswith("__init__"):
                seen.add(w)
                todo.append(w)
    for name, path in modules.items():
        text = path.read_text()
        if re.search(DECIDES, text) or (re.search(LAYER_ATTRIBUTES, text) and "ColumnParallelLinear" in text):
            seen.add(name)
    files = sorted(seen)
    return files, sum(len(_path(m).read_text().splitlines()) for m in files if _path(m).exists())


if __name__ == "__main__":
    edges = graph()
    found = circles(edges)
    files, lines = column_linear_reading(edges)
    print(f"{'measure':<52} | value")
    print("-" * 53 + "+" + "-" * 30)
    print(f"{'import circles (all imports but TYPE_CHECKING ones)':<52} | {len(found)}")
    for component in found:
        print(f"{'':<52} |   {' <-> '.join(m.split('.', 1)[1] for m in component)}")
    print(f"{'files to read for a column-parallel linear':<52} | {len(files)} ({lines} lines)")
    for name in files:
        print(f"{'':<52} |   {name.split('.', 1)[1]}")
    paths = list(ROOT.rglob("*.py"))
    total = sum(len(p.read_text().splitlines()) for p in paths)
    print(f"{'python files / lines in the package':<52} | {len(paths)} / {total}")
