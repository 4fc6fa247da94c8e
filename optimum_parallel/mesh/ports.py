"""A free TCP port on this host, for a rendezvous store (MASTER_PORT) the caller is about to start: the one helper
the benchmark scripts and the tests use. The port is free when asked; another process may still take it before the
store binds it, as with any such probe."""

from __future__ import annotations

import socket
from collections.abc import Iterable

LOCALHOST = "127.0.0.1"


def free_port(candidates: Iterable[int] | None = None, host: str = LOCALHOST) -> int:
    """The first of `candidates` that can be bound on `host` (by default: any port the system picks)."""
    for port in candidates or [0]:
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise RuntimeError(f"no free port on {host} among the candidates")
