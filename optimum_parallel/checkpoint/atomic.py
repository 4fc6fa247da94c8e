"""Atomic directory publishing: write into a temporary sibling, then swap it into place.

A crash at any point leaves either the previous directory or the new one at the final path,
never a mix; an interrupted temporary directory carries no completion marker and is rejected.
"""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path

from .crash import crash_point

_RENAME_EXCHANGE = 2  # linux/fs.h


def partial_dir(final: Path) -> Path:
    """Where a save into `final` is written before it is published (same filesystem, so rename is atomic)."""
    return final.parent / f".{final.name}.partial"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with renameat2(RENAME_EXCHANGE); False where the OS cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    return result == 0


def publish(tmp: Path, final: Path) -> None:
    """Move the finished `tmp` directory to `final`, replacing an existing `final` atomically."""
    final.parent.mkdir(parents=True, exist_ok=True)
    crash_point("publish")
    if final.exists():
        if not final.is_dir():
            raise FileExistsError(f"{final} exists and is not a directory")
        if _exchange(tmp, final):  # tmp now holds the previous checkpoint
            crash_point("published")
            fsync_dir(final.parent)
            shutil.rmtree(tmp)
            return
        old = final.parent / f".{final.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)  # fallback: a crash right here leaves the previous checkpoint at `old`
        os.rename(tmp, final)
        fsync_dir(final.parent)
        shutil.rmtree(old)
        return
    os.rename(tmp, final)
    crash_point("published")
    fsync_dir(final.parent)
