"""Make this checkout importable as the installed package without pip or setuptools: a `.dist-info` folder holding
pyproject.toml's entry points (the parallelizers are found through them), for scripts/device_check.sh on a machine
whose python cannot build an editable install offline. Put the folder given on sys.path (PYTHONPATH)."""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib


def main(target: str) -> int:
    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
    info = Path(target) / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    lines = []
    for group, points in project.get("entry-points", {}).items():
        lines += [f"[{group}]", *(f"{name} = {value}" for name, value in points.items()), ""]
    (info / "entry_points.txt").write_text("\n".join(lines))
    print(f"entry points of {project['name']} in {info}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
