"""What the parallelism packages record on a parallel model, in one typed place (see `record.py`)."""

from .record import ParallelState, find_state, parallel_state, refuse

__all__ = ["ParallelState", "find_state", "parallel_state", "refuse"]
