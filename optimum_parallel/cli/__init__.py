"""`optimum-parallel ...`: the command line."""

from .commands import main

__all__ = ["main"]
