"""The rooms of the package import one way (see docs/architecture.md), and no engine room imports a family."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "optimum_parallel"

# lower imports nothing higher; rooms on one level may import each other
LEVELS = {
    "mesh": 0,
    "state": 0,
    "comm": 1,
    "tensor_parallel": 2,
    "io": 3,
    "styles": 3,
    "context_parallel": 3,
    "expert_parallel": 3,
    "plan": 4,
    "pipeline": 4,
    "checkpoint": 4,
    "engine": 5,
    "frontends": 6,
    "integrations": 7,
    "planning": 8,
    "cli": 9,
    "families": 10,
}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "optimum_parallel" else None


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every optimum_parallel import in `path` (relative ones resolved)."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    found = []
    tree = ast.parse(path.read_text())
    type_only = {  # imports under `if TYPE_CHECKING:` name types in annotations; nothing runs them
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        for child in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [f"{module}.{alias.name}" for alias in node.names] if not node.module else [module]
            found += [(node.lineno, name) for name in names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return [(line, m) for line, m in found if m.startswith("optimum_parallel")]


def test_every_room_has_a_level():
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == set(LEVELS), f"rooms without a level (add them to LEVELS and the docs): {rooms ^ set(LEVELS)}"


def test_imports_run_one_way():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = _room(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        if here is None or here not in LEVELS:  # the package root re-exports the public API
            continue
        for line, module in _imports(path):
            there = _room(module)
            if there in LEVELS and LEVELS[there] > LEVELS[here]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({here}) imports {module} ({there})")
    assert not wrong, "imports against the arrows:\n" + "\n".join(wrong)
