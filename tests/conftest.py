"""Shared fixtures: one pool of real gloo worker processes per test module."""

from __future__ import annotations

import pytest
from _pool import WorkerPool


@pytest.fixture(scope="module")
def pool(request):
    """Workers started once for the module: `WORLD_SIZE = N` at module level picks how many (default 4)."""
    workers = WorkerPool(getattr(request.module, "WORLD_SIZE", 4))
    yield workers
    workers.close()
