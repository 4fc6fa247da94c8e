"""Packed sequences: several documents per row, no token attending to another document.

`pack` / `packed_inputs` put a batch whose rows hold several documents (restarting `position_ids`, `cu_seq_lens_q/k`,
`seq_idx`) in one form, the segment-encoded positions; `segment_ids` reads the documents back from it; `install_packing`
is the forward pre-hook the engine installs on every layout; `relay_rows` lays a packed batch's documents out in a
given number of rows (a pipeline's micro-batches).
"""

from .documents import IGNORE_INDEX, PACKING_KEYS, Packed, pack, packed_inputs, restarts, segment_ids
from .hook import install_packing
from .pipeline import carrier, is_carrier
from .rows import relay_rows

__all__ = [
    "IGNORE_INDEX",
    "PACKING_KEYS",
    "Packed",
    "carrier",
    "install_packing",
    "is_carrier",
    "pack",
    "packed_inputs",
    "relay_rows",
    "restarts",
    "segment_ids",
]
