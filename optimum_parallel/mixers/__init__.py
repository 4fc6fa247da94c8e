"""Token mixers that carry a state along the sequence (gated delta nets, Mamba mixers, short convolutions): one
device's answer on the whole sequence under context parallelism and over packed documents.

`plan_mixer` decides, before anything changes, how each mixer runs under cp (its heads split once more, or whole);
`install_mixers` wraps each mixer's forward (`runner.py`) and marks the decoder's forwards (`marker.py`) so every
mixer learns the whole sequence's padding, documents and cp layout.
"""

from .marker import SequenceMarker, builds_recurrent_mask, current_marker
from .plan import MixerSpec, check_heads_split, plan_mixer
from .runner import install_mixers

__all__ = [
    "MixerSpec",
    "SequenceMarker",
    "builds_recurrent_mask",
    "check_heads_split",
    "current_marker",
    "install_mixers",
    "plan_mixer",
]
