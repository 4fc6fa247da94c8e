"""The subpackages import one way (import-linter's contracts, pyproject.toml; docs/architecture.md), and
device specifics live in mesh/device.py only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "optimum_parallel"

ROOT = PACKAGE.parent


def test_the_import_linter_contracts_are_kept():
    """The subpackages' one-way arrows and no import circles: import-linter's contracts in pyproject.toml (the one list
    of the levels; `make lint` runs the same), run here so `make test` fails on a wrong import too."""
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


# ---- device specifics live in mesh/device.py only ---------------------------------------------------------------
DEVICE_MODULE = PACKAGE / "mesh" / "device.py"
# every device type torch can name (torch.device), lower case; "privateuseone" is the unrenamed PrivateUse1
DEVICE_NAMES = {
    "cpu", "cuda", "hip", "xla", "xpu", "mps", "meta", "hpu", "mtia", "maia", "npu", "neuron", "ipu", "lazy",
    "vulkan", "ve", "fpga", "mkldnn", "opengl", "opencl", "ideep", "privateuseone",
}  # fmt: skip
DEVICE_FLAGS = {"is_cuda", "is_xpu", "is_mps", "is_xla", "is_hpu", "is_mtia", "is_maia", "is_ipu", "is_vulkan"}


def _is_device_type(node: ast.AST) -> bool:
    """`x.type`, `x.device_type`, `device_type`: an expression holding a device type."""
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return name == "type" or name.endswith("device_type")


def _strings(node: ast.AST) -> list[str]:
    """The string literals `node` is (a literal) or holds (a tuple, list or set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for element in node.elts for s in _strings(element)]
    return []


def device_branches(source: str) -> list[tuple[int, str]]:
    """(line, what) of every device-specific spot in `source`: `torch.cuda` (used or imported), a tensor's
    `.is_cuda`-like flag, and a comparison of a device type to a string literal, or of anything to a device name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "torch" and node.attr == "cuda":
                found.append((node.lineno, "torch.cuda"))
        if isinstance(node, ast.Attribute) and node.attr in DEVICE_FLAGS:
            found.append((node.lineno, f".{node.attr}"))
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name.startswith("torch.cuda")]
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            cuda = node.module == "torch" and any(alias.name == "cuda" for alias in node.names)
            if cuda or node.module.startswith("torch.cuda"):
                found.append((node.lineno, f"from {node.module} import ..."))
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            literals = [s for operand in operands for s in _strings(operand)]
            names = [s for s in literals if s.lower() in DEVICE_NAMES]
            if names or (literals and any(_is_device_type(operand) for operand in operands)):
                found.append((node.lineno, f"compares to {(names or literals)[0]!r}"))
    return found


def test_device_branches_are_found():
    cases = {
        'if x.device.type == "xla": pass': 1,
        "ok = device_type != 'cuda'": 1,
        'if kind in ("cpu", "npu"): pass': 1,
        'if mode == "neuron": pass': 1,
        "torch.cuda.synchronize()": 1,
        "from torch import cuda": 1,
        "import torch.cuda.amp": 1,
        "if t.is_cuda: pass": 1,
        'if backend == "gloo" and x.is_meta: pass': 0,
        "device = torch.device(kind)\nif a.device.type == b.device.type: pass": 0,
    }
    for source, expected in cases.items():
        assert len(device_branches(source)) == expected, (source, device_branches(source))


def test_device_specifics_live_in_mesh_device_only():
    """No `torch.cuda` and no device-name branch in the package outside mesh/device.py: a new accelerator needs
    nothing but its torch package (and, where torch cannot tell, a line in mesh/device.py)."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == DEVICE_MODULE:
            continue
        for line, what in device_branches(path.read_text()):
            wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {what}")
    assert not wrong, "device specifics outside optimum_parallel/mesh/device.py (ask it instead):\n" + "\n".join(wrong)
