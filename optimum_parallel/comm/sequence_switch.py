"""Whether the sequence-parallel region is split in the forward running now.

A sequence-parallel plan splits the sequence at the region's entry. A forward whose sequence length the
tp size does not divide (a one-token decode step), or that keeps only the last positions' logits
(`logits_to_keep`, which `generate` passes), runs the plain tensor-parallel path instead: the entry leaves
the sequence whole and every sequence-parallel layer falls back to its tensor-parallel collective. Same
weights, same results; the decision is taken once per forward, at the region's entry, from shapes every tp
rank shares, so the ranks always agree. Forwards run one at a time in a thread: one switch (per thread) serves them all.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager


class SequenceSwitch(threading.local):
    """`on`: the current forward splits the sequence; `forced_off`: a caller asked for the plain path. Per thread:
    on XLA one process may run several ranks, one thread each."""

    def __init__(self) -> None:
        self.on = True
        self.forced_off = 0

    def decide(self, seq_len: int, tp: int) -> bool:
        """At the region's entry: split this forward's sequence or not."""
        self.on = not self.forced_off and seq_len % tp == 0
        return self.on

    def __call__(self, flag: bool) -> bool:
        """A layer's `sequence_parallel` flag as it applies to the current forward."""
        return bool(flag) and self.on

    def force_off(self) -> None:
        """Until the matching `release`, forwards leave the sequence whole (nests)."""
        self.forced_off += 1

    def release(self) -> None:
        self.forced_off -= 1

    @contextmanager
    def off(self):
        """Run the forwards inside without splitting the sequence."""
        self.force_off()
        try:
            yield
        finally:
            self.release()


sequence_switch = SequenceSwitch()
