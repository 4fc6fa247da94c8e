"""transformers: the Trainer, its arguments, lazy `from_pretrained`, and the private symbols they rely on."""
