"""Per-token log-probabilities, entropy and top-1 correctness of logits split over the vocabulary, never gathered.

What DPO, GRPO and SFT's metrics read from a model: `log_softmax(logits)[label]` per token (with its gradient), the
entropy of each token's distribution and whether the label is the argmax. Under tp the LM head's logits hold this
rank's slice of the vocabulary, ids [vocab_start, vocab_start + V_local): the log-probability is minus the
vocab-parallel cross-entropy (`loss.py`: the max, then the label's logit and the sum of exponentials, reduced over
the group); the entropy, the correctness and the mean logit come from the same three reductions (plus the max of the
logits before the label, for argmax's first-index tie rule), O(tokens) numbers on the wire. `group=None`: whole
logits on one rank (tp=1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup, ReduceOp

from ..comm.collectives import all_reduce
from ..mesh import ranks
from .layers import ColumnParallelLinear
from .loss import vocab_parallel_cross_entropy

IGNORE_INDEX = -100


@dataclass(frozen=True)
class VocabSlice:
    """Where a model's logits come from: `group` (None: whole logits), the first vocabulary id this rank's logits
    hold, and the whole vocabulary's size."""

    group: ProcessGroup | None
    vocab_start: int
    vocab_size: int


def vocab_slice(model: nn.Module) -> VocabSlice:
    """The vocabulary slice `model`'s logits hold on this rank: its vocab-parallel LM head's group and first id (as
    `plan/fixups.install_vocab_parallel_loss` reads them), or the whole vocabulary. Works on a PEFT model too."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    head = getattr(head, "base_layer", head)  # an adapter wrapping the head
    if isinstance(head, ColumnParallelLinear) and not head.gather_output:
        layout = getattr(head.weight, "shard_layout", None)  # FSDP2 replaces the parameter: then the shard sizes
        start = layout.ranges[0][0] if layout is not None else sum(head.output_sizes[: ranks.rank(head.group)])
        return VocabSlice(head.group, start, head.out_features)
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"{type(model).__name__} has no output embeddings (get_output_embeddings() is None)")
    return VocabSlice(None, 0, head.weight.shape[0])


def token_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group: ProcessGroup | None = None,
    vocab_start: int = 0,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """log p(label) per token, in fp32, with its gradient (0 where `labels == ignore_index`). `logits`: (..., V_local)
    holding ids [vocab_start, vocab_start + V_local) of the vocabulary split over `group`; `labels`: (...), already
    aligned with the logits (shift them first for a causal LM)."""
    flat, targets = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).to(logits.device)
    if group is None:
        loss = F.cross_entropy(flat.float(), targets, ignore_index=ignore_index, reduction="none")
    else:
        loss = vocab_parallel_cross_entropy(flat, targets, group, vocab_start, ignore_index)
    return (-loss).reshape(labels.shape)


@dataclass
class TokenStatistics:
    """Per-token numbers of one set of logits (no gradient), each 0 / False where the label is ignored."""

    entropy: torch.Tensor  # of the next-token distribution, in nats
    correct: torch.Tensor  # the label is the argmax (the first of equal maxima, as torch.argmax picks)
    mean_logit: torch.Tensor  # the mean logit over the whole vocabulary
    log_prob: torch.Tensor  # log p(label), without gradient
    log_sum_sq_probs: torch.Tensor  # log(sum_v p_v^2), WPO's weights


@torch.no_grad()
def token_statistics(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group: ProcessGroup | None = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> TokenStatistics:
    """Entropy, argmax correctness, mean logit, log p(label) and log sum p^2 per token of vocab-parallel `logits` (see
    `token_log_probs` for the arguments; `vocab_size`: the whole vocabulary, default V_local when `group` is None).
    Two all-reduces over `group` of O(tokens) numbers: the maxima, then the sums."""
    x = logits.reshape(-1, logits.shape[-1]).float()
    target = labels.reshape(-1).to(x.device)
    local = x.shape[-1]
    ids = torch.arange(local, device=x.device)
    local_target = target - vocab_start
    ours = (local_target >= 0) & (local_target < local)
    # the max over the whole vocabulary, and over the ids before the label (argmax's first-index rule)
    before = x.masked_fill(ids[None, :] >= local_target.clamp(0, local)[:, None], float("-inf")).amax(dim=-1)
    maxima = torch.stack([x.amax(dim=-1), before])
    if group is not None:
        maxima = all_reduce(maxima, group, op=ReduceOp.MAX)
    row_max, max_before = maxima
    shifted = x - row_max[:, None]
    exp = shifted.exp()
    label_logit = x.gather(-1, local_target.clamp(0, local - 1)[:, None]).squeeze(-1).masked_fill(~ours, 0.0)
    sums = torch.stack([exp.sum(-1), (exp * shifted).sum(-1), x.sum(-1), label_logit, exp.square().sum(-1)])
    if group is not None:
        sums = all_reduce(sums, group)
    sum_exp, shifted_sum_exp, logit_sum, label_logit, sum_sq_exp = sums
    ignored = target == ignore_index
    log_z = sum_exp.log()  # of the shifted logits
    entropy = log_z - shifted_sum_exp / sum_exp
    correct = (label_logit >= row_max) & (label_logit > max_before)
    log_prob = label_logit - row_max - log_z
    shape = labels.shape
    return TokenStatistics(
        entropy=entropy.masked_fill(ignored, 0.0).reshape(shape),
        correct=(correct & ~ignored).reshape(shape),
        mean_logit=(logit_sum / (vocab_size or local)).masked_fill(ignored, 0.0).reshape(shape),
        log_prob=log_prob.masked_fill(ignored, 0.0).reshape(shape),
        log_sum_sq_probs=(sum_sq_exp.log() - 2 * log_z).masked_fill(ignored, 0.0).reshape(shape),
    )


def token_entropy(
    logits: torch.Tensor, labels: torch.Tensor, group: ProcessGroup | None = None, vocab_start: int = 0
) -> torch.Tensor:
    """Entropy of each token's next-token distribution (0 where the label is ignored), without gradient."""
    return token_statistics(logits, labels, group, vocab_start).entropy


def token_correct(
    logits: torch.Tensor, labels: torch.Tensor, group: ProcessGroup | None = None, vocab_start: int = 0
) -> torch.Tensor:
    """Whether each token's label is the argmax of its logits (False where the label is ignored)."""
    return token_statistics(logits, labels, group, vocab_start).correct
