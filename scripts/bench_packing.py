"""Packed rows against rows padded to the longest document at cp=2: tokens/s and the attention work of each cp rank.

    python scripts/bench_packing.py                  # Llama hidden 256, 2 layers, 4 heads; 16k tokens per row
    python scripts/bench_packing.py --seq 8192       # a shorter row (and longest document), for a slow machine

The documents are one long-tailed mix (log-normal lengths, median --median, the longest --longest, at least one of
that length), filling --seq tokens. Packed: one row of every document, position ids restarting at each (the cp
layout deals the row's chunks to the ranks by attention work and skips chunk pairs of different documents). Padded:
the same documents, one per row, right-padded to the longest with an attention mask (what a padding collator gives),
in micro-batches of at most --seq padded tokens whose gradients are summed before the one optimizer step. Both run on
two processes (one intra-op thread each) at cp=2, ring attention, fp32, AdamW. tokens/s counts the documents' tokens
only. Attention work is the (query, key) pairs each rank's forward computes (a causal diagonal block counts half),
counted in the attention blocks themselves. Goals (issue 36): packed >= 1.5x padded tokens/s; the busiest rank's
packed attention work <= 1.1x the mean.
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch
from _common import (
    add_llama_args,
    add_run_args,
    build_llama,
    llama_config,
    print_table,
    quiet_transformers,
    timed_steps,
)
from _ranks import run_on_ranks


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_llama_args(parser, seq=16384, layers=2, vocab=4096, seq_help="tokens per packed row (documents' tokens)")
    parser.set_defaults(hidden=256, heads=4)
    add_run_args(parser, deadline=1800, deadline_help="seconds before the cp=2 workers are killed")
    parser.add_argument("--median", type=int, default=256, help="median document length")
    parser.add_argument("--longest", type=int, default=None, help="longest document (default: --seq / 4)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per variant (median), after one warm-up")
    return parser.parse_args(argv)


def document_lengths(args: argparse.Namespace) -> list[int]:
    """Log-normal lengths (sigma 1.2) in [16, longest], one of them the longest, summing to --seq exactly."""
    longest = args.longest or args.seq // 4
    gen = torch.Generator().manual_seed(args.seed + 7)
    lengths = [longest]
    while sum(lengths) < args.seq:
        draw = float(torch.empty(1).log_normal_(mean=float(torch.tensor(args.median).log()), std=1.2, generator=gen))
        lengths.append(max(16, min(longest, int(draw))))
    lengths[-1] -= sum(lengths) - args.seq
    if lengths[-1] < 2:
        lengths[-2] += lengths.pop()
    order = torch.randperm(len(lengths), generator=gen).tolist()
    return [lengths[i] for i in order]


def packed_batches(lengths: list[int], vocab: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, vocab, (1, sum(lengths)), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return [{"input_ids": ids, "labels": ids.clone(), "position_ids": positions}]


def padded_batches(lengths: list[int], vocab: int, seed: int, budget: int) -> list[dict]:
    """The documents (the same tokens as `packed_batches`) one per row, padded to the longest, in micro-batches of
    at most `budget` padded tokens."""
    gen = torch.Generator().manual_seed(seed + 1)
    flat = torch.randint(0, vocab, (sum(lengths),), generator=gen)
    longest, per_batch = max(lengths), max(1, budget // max(lengths))
    docs = flat.split(lengths)
    batches = []
    for start in range(0, len(docs), per_batch):
        group = docs[start : start + per_batch]
        ids = torch.zeros(len(group), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, doc in enumerate(group):
            ids[row, : len(doc)], mask[row, : len(doc)] = doc, 1
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return batches


class AttentionWork:
    """(query, key) pairs the cp attention blocks compute on this rank, per head and row."""

    def __init__(self) -> None:
        self.pairs = 0

    def install(self) -> None:
        from optimum_parallel.context_parallel import blocks

        original = blocks.pair_forward

        def counting(q, k, v, kind, visible, attend, use_fused):
            rows, heads, queries, keys = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
            pairs = queries * (queries + 1) // 2 if kind == "causal" else queries * keys
            self.pairs += rows * heads * pairs
            return original(q, k, v, kind, visible, attend, use_fused)

        blocks.pair_forward = counting


def dealt_work(lengths: list[int], cp: int) -> list[int]:
    """Per rank, the (query, key) pairs of its queries inside their documents (per head): the work the packed layout
    deals out; the computed blocks add what masked chunk pairs spend on pairs of other documents."""
    from optimum_parallel.context_parallel.packed import chunk_count, chunk_work, deal
    from optimum_parallel.packing import segment_ids

    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    chunks, padded = chunk_count(positions.shape[1], cp)
    positions = torch.cat([positions, torch.zeros(1, padded - positions.shape[1], dtype=torch.long)], 1)
    work = chunk_work(segment_ids(positions), chunks)
    return [sum(work[j] for j in mine) for mine in deal(work, cp)]


def _step(model, optimizer, batches: list[dict]) -> None:
    tokens = sum(int((b["labels"] != -100).sum()) for b in batches)
    for batch in batches:
        loss = model(**batch).loss * (int((batch["labels"] != -100).sum()) / tokens)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def cp_rank(rank: int, world: int, args: argparse.Namespace, lengths: list[int]) -> dict:
    import torch.distributed as dist

    import optimum_parallel as op

    quiet_transformers()
    mesh = op.init_mesh(cp=world, tp=1)
    work = AttentionWork()
    work.install()
    variants = {
        "packed": packed_batches(lengths, args.vocab, args.seed),
        "padded": padded_batches(lengths, args.vocab, args.seed, args.seq),
    }
    results = {}
    for name, batches in variants.items():
        model = build_llama(args, "sdpa", llama_config(args, args.seq))
        model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(model)
        model, _ = op.parallelize(model, None, mesh, {"dp_config": {"sharding_level": 0}})  # gradients over cp
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        _step(model, optimizer, batches)  # warm-up
        work.pairs = 0
        times = timed_steps(partial(_step, model, optimizer, batches), timed=args.steps)
        pairs = [None] * world
        dist.all_gather_object(pairs, work.pairs // args.steps)
        results[name] = {"s": times.median, "pairs": pairs, "micro_batches": len(batches)}
        if rank == 0:
            print(f"  {name}: {results[name]['s']:.2f} s per step, attention pairs per rank {pairs}", flush=True)
        del model, optimizer
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet_transformers()
    lengths = document_lengths(args)
    tokens = sum(lengths)
    print(
        f"{len(lengths)} documents, {tokens} tokens: longest {max(lengths)}, median "
        f"{int(statistics.median(lengths))}, mean {tokens / len(lengths):.0f}; padded rows hold "
        f"{len(lengths) * max(lengths)} tokens ({len(lengths) * max(lengths) / tokens:.1f}x)",
        flush=True,
    )
    results = run_on_ranks(2, cp_rank, (args, lengths), args.deadline, "cp=2")
    print(
        f"\nLlama hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocab {args.vocab}, fp32, AdamW, "
        f"cp=2 ring; median of {args.steps} steps after 1\n"
    )
    header = (
        "layout",
        "micro-batches",
        "step s",
        "tokens/s",
        "x padded",
        "attention pairs per rank (M)",
        "busiest / mean",
    )
    rows = []
    padded_rate = tokens / results["padded"]["s"]
    for name in ("packed", "padded"):
        r = results[name]
        rate = tokens / r["s"]
        pairs = r["pairs"]
        balance = max(pairs) / (sum(pairs) / len(pairs))
        rows.append(
            (
                name,
                r["micro_batches"],
                f"{r['s']:.2f}",
                f"{rate:.0f}",
                f"{rate / padded_rate:.2f}x",
                " / ".join(f"{p / 1e6:.1f}" for p in pairs),
                f"{balance:.3f}",
            )
        )
    print_table(header, rows, align_numbers=True)
    speed = results["padded"]["s"] / results["packed"]["s"]
    pairs = results["packed"]["pairs"]
    balance = max(pairs) / (sum(pairs) / len(pairs))
    print(f"\npacked tokens/s: {speed:.2f}x padded ({'PASS' if speed >= 1.5 else 'FAIL'} >= 1.5)")
    verdict = "PASS" if balance <= 1.1 else "FAIL"
    print(f"busiest rank's packed attention work (computed blocks): {balance:.3f}x the mean ({verdict} <= 1.1)")
    dealt = dealt_work(lengths, 2)
    print(f"busiest rank's document pairs (what the layout deals): {max(dealt) / (sum(dealt) / 2):.3f}x the mean")


if __name__ == "__main__":
    main()
