"""Inference on a tensor-parallel model: logits, `generate` and a text-generation pipeline, against one process.

    torchrun --nproc-per-node 2 examples/generate.py        # tp=2 on CPU (gloo) or GPUs (NCCL)

A small random Llama (no hub access) is parallelized at tp=2 with the Parallelizer front door. Every rank runs
the same calls with the same prompts; every rank gets the full-vocabulary logits and the same tokens, which
match the single-process model's.
"""

from __future__ import annotations

import copy

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, pipeline

import optimum_parallel as op


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Whitespace-separated words "w0".."w{vocab-1}" (w0 pads, w2 ends): a tokenizer without downloads."""
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w3"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="w3", pad_token="w0", bos_token="w1", eos_token="w2", padding_side="left"
    )


def main() -> None:
    op.init_mesh(tp=2)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    single = AutoModelForCausalLM.from_config(config).eval()
    model = op.ParallelizersManager.parallelizer_for_model(single).parallelize(copy.deepcopy(single))
    rank = torch.distributed.get_rank()

    tokenizer = word_tokenizer(config.vocab_size)
    batch = tokenizer(["w5 w9 w17 w33 w65 w129", "w100 w7 w44"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits  # the whole vocabulary, the same on every rank
    same = torch.allclose(logits, single(**batch).logits, atol=1e-5)
    print(f"rank {rank}: logits {tuple(logits.shape)}, equal to one process: {same}")

    for name, options in {
        "greedy": dict(do_sample=False),
        "beam search": dict(do_sample=False, num_beams=3),
        "sampling": dict(do_sample=True, top_p=0.9),
    }.items():
        torch.manual_seed(1)  # sampling: every rank draws with tp rank 0's generator state
        tokens = model.generate(**batch, max_new_tokens=8, **options)
        torch.manual_seed(1)
        same = torch.equal(tokens, single.generate(**batch, max_new_tokens=8, **options))
        print(f"rank {rank}: {name:11s} {tokens[0, -8:].tolist()} same as one process: {same}")

    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    text = generator("w5 w9 w17", max_new_tokens=5, do_sample=False)[0]["generated_text"]
    print(f"rank {rank}: pipeline -> {text!r}")


if __name__ == "__main__":
    main()
