"""File I/O below the checkpoints and lazy loading: safetensors reading/writing, file mappings, slice reads."""
