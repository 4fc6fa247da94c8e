"""Common steps of a custom training loop (per-rank seeding, a sampler over the world, torch's clipping, an optimizer
made before parallelize, save_pretrained), tried as a user writes them, at tp=2 (2 ranks): what each one gives.

    torchrun --nproc-per-node 2 scripts/custom_loop_checks.py

One line per step: a silently different model (the figure that shows it), or the error the package raises. Each
scenario is a tiny random-init model (no hub) against the same training on one process where a reference applies.
"""

from __future__ import annotations

import copy
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

TINY = dict(vocab_size=128, num_hidden_layers=2, max_position_embeddings=64, tie_word_embeddings=False)


def llama():
    config = AutoConfig.for_model(
        "llama", hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, **TINY
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()


def gpt2(dropout: float = 0.2):
    config = AutoConfig.for_model(
        "gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64, resid_pdrop=dropout,
        embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()


def batch(rows: int = 4, seq: int = 16, seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (rows, seq), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def replicated_differing(model) -> tuple[int, int]:
    """(replicated parameters that differ between the two tp ranks, replicated parameters)."""
    names = [n for n, p in model.named_parameters() if getattr(p, "shard_layout", None) is None]
    differing = 0
    for name in names:
        p = dict(model.named_parameters())[name].detach()
        other = p.clone()
        dist.broadcast(other, src=0)
        differing += int(not torch.equal(other, p))
    return differing, len(names)


def parallel(model):
    import optimum_parallel as op

    return op.ParallelizersManager.parallelizer_for_model(model).parallelize(model)


def check_seed_per_rank() -> str:
    """Ranks seeded seed + rank at the top of the script, dropout on (GPT-2, p=0.2), 3 SGD steps."""
    model = gpt2()
    torch.manual_seed(100 + dist.get_rank())
    model = parallel(model)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(**batch()).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    differing, total = replicated_differing(model)
    return f"{differing} of {total} replicated parameters differ between the tp ranks after 3 steps"


def check_torch_clip() -> str:
    """torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5), 3 SGD steps."""
    model = parallel(llama())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = []
    for _ in range(3):
        model(**batch()).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        optimizer.step()
        optimizer.zero_grad()
    differing, total = replicated_differing(model)
    return f"rank {dist.get_rank()} clipped by norm {norms[0]:.3f}; {differing} of {total} replicated parameters differ"


def check_sampler_over_world() -> str:
    """A DistributedSampler over the whole world: each tp rank is given other rows."""
    model = parallel(llama())
    rows = batch(rows=4)
    mine = {k: v[dist.get_rank() :: 2] for k, v in rows.items()}  # what DistributedSampler(num_replicas=2) yields
    loss = model(**mine).loss
    reference = llama()
    per_rank = [reference(**{k: v[r::2] for k, v in rows.items()}).loss.item() for r in range(2)]
    return f"loss {loss.item():.4f}; one process on rank 0's rows {per_rank[0]:.4f}, on rank 1's {per_rank[1]:.4f}"


def check_optimizer_first() -> str:
    """AdamW(model.parameters()) made before parallelize, no optimizer_for_mp, 4 steps, against one process."""
    reference = llama()
    model = copy.deepcopy(reference)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model = parallel(model)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses, ref_losses = [], []
    for _ in range(4):
        loss = model(**batch()).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = reference(**batch()).loss
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        losses.append(round(loss.item(), 3))
        ref_losses.append(round(ref_loss.item(), 3))
    return f"losses {losses}, one process {ref_losses}"


def check_save_pretrained() -> str:
    """model.save_pretrained(dir) on every rank after a step, then from_pretrained on one process."""
    model = parallel(llama())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(**batch()).loss.backward()
    optimizer.step()
    path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    model.save_pretrained(path[0])
    dist.barrier()
    with torch.no_grad():
        logits = model(input_ids=batch()["input_ids"]).logits
    try:
        loaded = AutoModelForCausalLM.from_pretrained(path[0], attn_implementation="eager").float()
    except Exception as err:
        return f"from_pretrained failed: {type(err).__name__}: {str(err).splitlines()[0][:110]}"
    with torch.no_grad():
        again = loaded(input_ids=batch()["input_ids"]).logits
    error = ((again - logits).abs().max() / logits.abs().max()).item()
    return f"from_pretrained loads it; logits relative error {error:.2e} against the trained model"


CHECKS = {
    "seeds per rank, dropout": check_seed_per_rank,
    "torch's clip_grad_norm_": check_torch_clip,
    "a sampler over the world": check_sampler_over_world,
    "an optimizer made first": check_optimizer_first,
    "save_pretrained": check_save_pretrained,
}


def main() -> None:
    import optimum_parallel as op

    op.init_mesh(tp=2, timeout=60)
    rows = []
    for name, check in CHECKS.items():
        try:
            outcome = check()
        except Exception as err:  # the package's refusal: what the user reads
            message = str(err).strip().splitlines()[0] if str(err).strip() else ""
            outcome = f"raises {type(err).__name__}: {message[:150]}"
            if os.environ.get("CUSTOM_LOOP_TRACEBACK"):
                traceback.print_exc()
        outcomes = [None, None]
        dist.all_gather_object(outcomes, outcome)
        rows.append((name, outcomes))
    if dist.get_rank() == 0:
        print(f"{'loop step':<26} | rank | outcome")
        print("-" * 27 + "+------+" + "-" * 100)
        for name, outcomes in rows:
            for rank, outcome in enumerate(outcomes):
                print(f"{name if rank == 0 else '':<26} | {rank:>4} | {outcome}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
