"""The one error type of checkpoint handling: always names the offending file (and tensor)."""


class CheckpointError(ValueError):
    """A checkpoint is incomplete, corrupted, or does not fit the model / mesh it is loaded into."""
