"""What the XLA tests and their worker share: the tiny model, the batch, the training steps, the comparisons."""

from __future__ import annotations

import torch

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    pad_token_id=0,  # a padding row: its gradient is masked on the one rank that holds it
)
STEPS = 3
LR = 1e-2
EPS = 1e-6  # AdamW normalises each gradient: a 1e-8 one (float noise) would move its weight by ~lr with eps 1e-8


def save_tiny_llama(directory) -> None:
    """A tiny random Llama written with `save_pretrained`: a real HF checkpoint."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY), attn_implementation="eager").float()
    model.save_pretrained(directory)


def load_llama(directory):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager", dtype=torch.float32)
    model.eval()  # no dropout: the same math on every device
    return model


def make_batch(batch: int = 2, seq: int = 16, seed: int = 1, replicas: int = 1) -> dict[str, torch.Tensor]:
    """input_ids with left padding (the pad id), its attention mask, labels with -100 on padding and more.
    `replicas` x `batch` rows: the first row of every replica's `batch` is padded, so every replica holds as many
    labelled tokens and the mean of the replicas' losses is the whole batch's (`replica_rows` gives one's share)."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, TINY["vocab_size"], (batch * replicas, seq), generator=gen)
    attention_mask = torch.ones(batch * replicas, seq, dtype=torch.long)
    attention_mask[0::batch, :3] = 0
    input_ids[attention_mask == 0] = TINY["pad_token_id"]
    labels = input_ids.clone()
    labels[attention_mask == 0] = -100
    labels[:, seq // 2] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def replica_rows(batch: dict[str, torch.Tensor], replica: int, replicas: int) -> dict[str, torch.Tensor]:
    """The rows of `batch` that data-parallel replica `replica` of `replicas` trains on (contiguous, in order)."""
    rows = next(iter(batch.values())).shape[0] // replicas
    return {k: v[replica * rows : (replica + 1) * rows] for k, v in batch.items()}


def shard_pieces(tensors: dict, params: dict) -> dict:
    """Each tensor on the CPU with its parameter's split: (local value, split dim or None, ranges) for `whole`."""
    found = {}
    for name, tensor in tensors.items():
        layout = getattr(params[name], "shard_layout", None)
        dim = layout.dim if layout is not None else None
        found[name] = (tensor.detach().cpu().clone(), dim, list(layout.ranges) if dim is not None else None)
    return found


def whole(pieces: list[tuple[torch.Tensor, int | None, list]], shape) -> torch.Tensor:
    """A tensor from every rank's (local value, split dim or None, ranges) (a replicated one: rank 0's)."""
    value, dim, _ = pieces[0]
    if dim is None:
        return value
    full = torch.full(tuple(shape), float("nan"), dtype=value.dtype)
    for local, _, ranges in pieces:
        offset = 0
        for start, end in ranges:
            full.narrow(dim, start, end - start).copy_(local.narrow(dim, offset, end - start))
            offset += end - start
    assert not full.isnan().any(), "the ranks' shards do not cover the tensor"
    return full


SPLIT_AT_TP = ("q_proj.weight", "down_proj.weight", "embed_tokens.weight", "lm_head.weight")


def check_split_over_tp(result: dict) -> None:
    """The big matrices are really split (a run that left them whole could not tell tp from one device)."""
    for name, (_, dim, _) in result["grads"].items():
        if name.endswith(SPLIT_AT_TP):
            assert dim is not None, f"{name} is not split over tp"


def check_world(results: list[dict], world: int) -> None:
    """Every one of `world` ranks reported, each in a world of that size (a run that fell back to one rank fails)."""
    assert len(results) == world, f"{len(results)} ranks reported, expected {world}"
    assert sorted(r["ordinal"] for r in results) == list(range(world))
    assert all(r["world"] == world for r in results), [r["world"] for r in results]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    actual, expected = actual.detach().double(), expected.detach().double()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()
