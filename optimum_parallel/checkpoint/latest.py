"""The newest complete checkpoint of a training run: what a restarted job resumes from."""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from pathlib import Path

from ..io.errors import CheckpointError
from .integrity import verify_checkpoint

_STEP = re.compile(r"^checkpoint-(\d+)$")
_INTERRUPTED = re.compile(r"^\.checkpoint-(\d+)\.(partial|old)$")


def find_last_checkpoint(output_dir: str | Path, required: Sequence[str] = ()) -> Path | None:
    """The `checkpoint-<step>` directory of `output_dir` with the highest step whose save completed (marker, index,
    every file present at its size, and the `required` files, e.g. the Trainer's `trainer_state.json`); None if
    there is none. Interrupted saves (`.checkpoint-<step>.partial`) and incomplete directories are skipped with a
    warning naming them."""
    directory = Path(output_dir)
    if not directory.is_dir():
        return None
    steps = []
    for path in directory.iterdir():
        if not path.is_dir():
            continue
        if _INTERRUPTED.match(path.name):
            warnings.warn(f"ignoring {path}: an interrupted checkpoint save", stacklevel=2)
        elif match := _STEP.match(path.name):
            steps.append((int(match.group(1)), path))
    for _, path in sorted(steps, reverse=True):
        try:
            verify_checkpoint(path, full=False)
            for name in required:
                if not (path / name).is_file():
                    raise CheckpointError(f"{path / name}: missing; the save into {path} did not complete")
        except CheckpointError as err:
            warnings.warn(f"ignoring {path}: {err}", stacklevel=2)
            continue
        return path
    return None
