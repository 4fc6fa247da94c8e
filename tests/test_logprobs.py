"""Per-token log-probabilities, entropy and argmax correctness of vocab-parallel logits (2 ranks, gloo): equal to
torch's log_softmax on the whole logits, values and gradients, with ignored labels, an uneven vocabulary split and
ties; and `vocab_slice` finds a parallel model's head."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from optimum_parallel.tensor_parallel.logprobs import (
    token_correct,
    token_entropy,
    token_log_probs,
    token_statistics,
    vocab_slice,
)

WORLD_SIZE = 2
VOCAB = 37  # uneven split: 19 + 18
TOL = 1e-6


def whole(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, VOCAB, generator=gen, dtype=torch.float64).float() * 3
    labels = torch.randint(0, VOCAB, (3, 5), generator=gen)
    labels[0, :2] = -100
    labels[2, 4] = -100
    # the label at the argmax on some tokens; a tie before the label on one (argmax takes the first)
    labels[1, 0] = logits[1, 0].argmax()
    labels[1, 1] = logits[1, 1].argmax()
    labels[2, 0] = 30
    logits[2, 0, 30] = logits[2, 0].max() + 1
    logits[2, 0, 4] = logits[2, 0, 30]
    return logits, labels


def reference(logits: torch.Tensor, labels: torch.Tensor):
    logits = logits.double().requires_grad_()
    log_probs = logits.log_softmax(-1)
    mask = labels != -100
    picked = log_probs.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * mask
    weights = torch.linspace(0.5, 2.0, labels.numel(), dtype=torch.float64).reshape(labels.shape)
    (picked * weights).sum().backward()
    entropy = -(log_probs.exp() * log_probs).sum(-1) * mask
    correct = (logits.argmax(-1) == labels) & mask
    sq = (log_probs.exp().square().sum(-1).log() * mask).detach()
    return picked.detach(), logits.grad, entropy.detach(), correct, (logits.mean(-1) * mask).detach(), sq


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def split_check(seed: int) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    logits, labels = whole(seed)
    start, stop = (0, 19) if rank == 0 else (19, VOCAB)
    local = logits[..., start:stop].clone().requires_grad_()
    log_probs = token_log_probs(local, labels, group, start)
    weights = torch.linspace(0.5, 2.0, labels.numel(), dtype=torch.float64).reshape(labels.shape).float()
    (log_probs * weights).sum().backward()
    stats = token_statistics(local, labels, group, start, vocab_size=VOCAB)
    return {
        "log_probs": log_probs.detach(),
        "grad": local.grad,
        "entropy": token_entropy(local, labels, group, start),
        "correct": token_correct(local, labels, group, start),
        "stats": stats,
        "range": (start, stop),
    }


def test_vocab_parallel_matches_log_softmax(pool):
    for seed in (0, 1):
        logits, labels = whole(seed)
        picked, grad, entropy, correct, mean_logit, sq = reference(logits, labels)
        assert correct[1, 0] and correct[1, 1] and not correct[2, 0]  # the tie: argmax is the first maximum
        results = pool.run(split_check, seed)
        full_grad = torch.cat([r["grad"] for r in results], dim=-1)
        assert rel(full_grad, grad) <= TOL
        for r in results:
            assert rel(r["log_probs"], picked) <= TOL
            assert rel(r["stats"].log_prob, picked) <= TOL
            assert rel(r["entropy"], entropy) <= TOL and rel(r["stats"].entropy, entropy) <= TOL
            assert torch.equal(r["correct"], correct) and torch.equal(r["stats"].correct, correct)
            assert rel(r["stats"].mean_logit, mean_logit) <= TOL
            assert rel(r["stats"].log_sum_sq_probs, sq) <= TOL


def test_whole_logits_on_one_rank():
    logits, labels = whole(2)
    picked, grad, entropy, correct, mean_logit, sq = reference(logits, labels)
    local = logits.clone().requires_grad_()
    log_probs = token_log_probs(local, labels)
    weights = torch.linspace(0.5, 2.0, labels.numel(), dtype=torch.float64).reshape(labels.shape).float()
    (log_probs * weights).sum().backward()
    assert rel(log_probs, picked) <= TOL and rel(local.grad, grad) <= TOL
    stats = token_statistics(logits, labels)
    assert rel(stats.entropy, entropy) <= TOL and torch.equal(stats.correct, correct)
    assert rel(stats.mean_logit, mean_logit) <= TOL and rel(stats.log_sum_sq_probs, sq) <= TOL
    assert rel(F.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
               * (labels != -100), stats.log_prob) <= TOL  # fmt: skip


def head_slice(model_type: str) -> tuple:
    from _models import build_model, tiny_config

    import optimum_parallel as op

    model = build_model(tiny_config(model_type), seed=0)
    mesh = op.init_mesh(tp=2)
    model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(model)
    found = vocab_slice(model)
    return found.vocab_start, found.vocab_size, found.group is not None, mesh.size("tp")


def test_vocab_slice_of_a_parallel_model(pool):
    starts = [r[0] for r in pool.run(head_slice, "llama")]
    assert starts == [0, 64]
    assert all(r[1] == 128 and r[2] for r in pool.run(head_slice, "qwen3"))
