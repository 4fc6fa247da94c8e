"""The tiny checkpoint the TRL examples train when no model is given: a random 2-layer Llama and a word-level
tokenizer (token i is the word `t{i}`), saved locally, no hub download."""

from __future__ import annotations

import os

import torch


def word_tokenizer(vocab_size: int):
    """Token i is the word `t{i}` (no hub download)."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t1"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex("t[0-9]+"), "isolated")]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0", eos_token="t2", unk_token="t1")


def tiny_checkpoint(path: str, vocab_size: int = 128) -> str:
    """A random 2-layer Llama and its tokenizer, saved once (the main process first)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if not os.path.exists(os.path.join(path, "config.json")):
        config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=2,
        )  # fmt: skip
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(path)
        word_tokenizer(vocab_size).save_pretrained(path)
    return path
