"""Tiny real transformers models and batches for the tests (random init, no hub)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
LLAMA_70B = dict(  # Llama 3 70B's sizes, for the planners (config only, meta models)
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
)


def tiny_config(model_type: str, **overrides):
    return AutoConfig.for_model(model_type, **{**TINY, **overrides})


def build_model(config, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    model.eval()  # no dropout, identical math on every rank
    return model


def make_batch(config, batch: int = 2, seq: int = 16, seed: int = 1) -> dict[str, torch.Tensor]:
    """input_ids, a left-padded attention_mask and labels with -100 on padding and a few more tokens."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    attention_mask[0, :3] = 0
    labels = input_ids.clone()
    labels[attention_mask == 0] = -100
    labels[:, seq // 2] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    actual, expected = actual.detach().double(), expected.detach().double()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def whole_logits(model, logits: torch.Tensor) -> torch.Tensor:
    """The full-vocabulary logits: a parallel model returns them, except from a training step (labels, grad on)."""
    head = model.get_output_embeddings()
    local = getattr(head, "logits_mode", None) is not None and logits.shape[-1] == head.weight.shape[0]
    return head.gather(logits) if local else logits
