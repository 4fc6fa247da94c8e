"""Per-token log-probabilities, entropy and top-1 correctness of logits split over the vocabulary, never gathered,
computed a chunk of tokens at a time (what DPO, GRPO and SFT's metrics read from a model).

`token_log_probs` (with gradient) and `token_statistics` take the logits; `head_token_scores` takes the hidden states
and this rank's slice of the LM head and never holds the logits. `group=None`: whole logits on one rank (tp=1).
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

IGNORE_INDEX = -100
CHUNK_ELEMENTS = 1 << 25  # logits per chunk of tokens (tokens x V_local): 128 MiB at fp32


def chunk_tokens(local_vocab: int, chunk_elements: int | None = None) -> int:
    """Tokens per chunk for logits of `local_vocab` columns: `chunk_elements` (default `CHUNK_ELEMENTS`) logits."""
    return max(1, (chunk_elements or CHUNK_ELEMENTS) // max(local_vocab, 1))


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


@dataclass(frozen=True)
class LogitTransform:
    """What a model does to its LM head's output before the softmax, as TRL's fused head reads it from the config:
    times `scale`, then `softcap * tanh(logits / softcap)` when `softcap` is set, then divided by `temperature`."""

    scale: float = 1.0
    softcap: float | None = None
    temperature: float = 1.0

    def apply_(self, y: torch.Tensor) -> torch.Tensor:
        """The transformed logits, in place in `y` (an fp32 tensor of the caller's own)."""
        if self.scale != 1.0:
            y.mul_(self.scale)
        if self.softcap is not None:
            y.div_(self.softcap).tanh_().mul_(self.softcap)
        if self.temperature != 1.0:
            y.div_(self.temperature)
        return y


@dataclass
class TokenStatistics:
    """Per-token numbers of one set of logits, each 0 / False where the label is ignored; without gradient, but for
    `log_prob` from `head_token_scores`."""

    entropy: torch.Tensor  # of the next-token distribution, in nats
    correct: torch.Tensor  # the label is the argmax (the first of equal maxima, as torch.argmax picks)
    mean_logit: torch.Tensor  # the mean logit over the whole vocabulary
    log_prob: torch.Tensor  # log p(label)
    log_sum_sq_probs: torch.Tensor  # log(sum_v p_v^2), WPO's weights


# ------------------------------------------------------------------------------------------------- one chunk


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise sum of a * b, without a tokens x vocab temporary."""
    return torch.einsum("nv,nv->n", a, b)


def _score_chunk(
    z: torch.Tensor, target: torch.Tensor, group: ProcessGroup | None, vocab_start: int, statistics: bool
) -> dict[str, torch.Tensor]:
    """The per-token reductions of one chunk of fp32 logits `z` (c, V_local), which it overwrites: the max, log Z
    and log p(label) (as log_softmax rounds it: (label logit - max) - log sum exp), and with `statistics` the sums the
    entropy, the correctness, the mean logit and log sum p^2 come from. Two all-reduces over `group`: the maxima,
    then the sums."""
    local = z.shape[-1]
    local_target = target - vocab_start
    ours = (local_target >= 0) & (local_target < local)
    index = local_target.clamp(0, local - 1)[:, None]
    maxima = [z.amax(dim=-1)]
    if statistics:  # the max over the ids before the label too (argmax's first-index rule), the label's logit
        before = torch.arange(local, device=z.device)[None, :] >= local_target.clamp(0, local)[:, None]
        maxima.append(z.masked_fill(before, float("-inf")).amax(dim=-1))
        label_logit = z.gather(-1, index).squeeze(-1).masked_fill(~ours, 0.0)
        logit_sum = z.sum(-1)
    maxima = torch.stack(maxima)
    if group is not None:
        maxima = all_reduce(maxima, group, op=ReduceOp.MAX)
    row_max = maxima[0]
    shifted = z.sub_(row_max[:, None])
    label_shifted = shifted.gather(-1, index).squeeze(-1).masked_fill(~ours, 0.0)
    exp = shifted.exp()
    sums = [exp.sum(-1), label_shifted]
    if statistics:
        sums += [_dot(exp, shifted), logit_sum, _dot(exp, exp), label_logit]
    del exp, shifted
    sums = torch.stack(sums)
    if group is not None:
        sums = all_reduce(sums, group)
    log_sum_exp = sums[0].log()  # of the shifted logits
    out = {"log_z": row_max + log_sum_exp, "log_prob": sums[1] - log_sum_exp}
    if statistics:
        sum_exp, shifted_sum_exp, logit_sum, sum_sq_exp, label_logit = sums[0], sums[2], sums[3], sums[4], sums[5]
        out["entropy"] = log_sum_exp - shifted_sum_exp / sum_exp
        out["correct"] = (label_logit >= row_max) & (label_logit > maxima[1])
        out["logit_sum"] = logit_sum
        out["log_sum_sq_probs"] = sum_sq_exp.log() - 2 * log_sum_exp
    return out


def _log_prob_grad_(z: torch.Tensor, target: torch.Tensor, log_z: torch.Tensor, scale: torch.Tensor, vocab_start: int):
    """d(scale * log p(label)) / dz for one chunk of fp32 logits `z` (c, V_local), in place in `z`:
    scale * (one_hot(label) - softmax). `scale` is 0 where the label is ignored."""
    local = z.shape[-1]
    grad = z.sub_(log_z[:, None]).exp_().mul_(-scale[:, None])
    local_target = target - vocab_start
    ours = (local_target >= 0) & (local_target < local)
    grad.scatter_add_(-1, local_target.clamp(0, local - 1)[:, None], (scale * ours)[:, None].to(grad.dtype))
    return grad


def _empty_scores(n: int, device: torch.device) -> dict[str, torch.Tensor]:
    scores = {name: torch.zeros(n, device=device) for name in ("log_prob", "log_z", "entropy", "mean_logit", "sq")}
    scores["correct"] = torch.zeros(n, dtype=torch.bool, device=device)
    return scores


def _fill(scores: dict, span: slice, chunk: dict, ignored: torch.Tensor, vocab_size: int) -> None:
    scores["log_z"][span] = chunk["log_z"]
    scores["log_prob"][span] = chunk["log_prob"].masked_fill(ignored, 0.0)
    if "entropy" in chunk:
        scores["entropy"][span] = chunk["entropy"].masked_fill(ignored, 0.0)
        scores["correct"][span] = chunk["correct"] & ~ignored
        scores["mean_logit"][span] = (chunk["logit_sum"] / vocab_size).masked_fill(ignored, 0.0)
        scores["sq"][span] = chunk["log_sum_sq_probs"].masked_fill(ignored, 0.0)


def _chunk_of(logits: torch.Tensor, span: slice) -> torch.Tensor:
    """fp32 logits of the tokens in `span`, a copy of the caller's (the chunk functions overwrite it)."""
    return logits[span].to(torch.float32, copy=True)


# ------------------------------------------------------------------------------------------- given logits


class _ChunkedLogProbs(torch.autograd.Function):
    """log p(label) of (N, V_local) logits, chunk by chunk; saves the logits it was given and log Z, and computes the
    softmax again per chunk in backward."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, ignore_index, chunk):
        n = logits.shape[0]
        scores = _empty_scores(n, logits.device)
        ignored = target == ignore_index
        for start in range(0, n, chunk):
            span = slice(start, min(start + chunk, n))
            scored = _score_chunk(_chunk_of(logits, span), target[span], group, vocab_start, statistics=False)
            _fill(scores, span, scored, ignored[span], 1)
        ctx.save_for_backward(logits, target, scores["log_z"], ignored)
        ctx.vocab_start, ctx.chunk = vocab_start, chunk
        return scores["log_prob"]

    @staticmethod
    def backward(ctx, grad_log_prob):
        logits, target, log_z, ignored = ctx.saved_tensors
        scale = grad_log_prob.float().masked_fill(ignored, 0.0)
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk):
            span = slice(start, min(start + ctx.chunk, logits.shape[0]))
            z = _chunk_of(logits, span)
            grad[span] = _log_prob_grad_(z, target[span], log_z[span], scale[span], ctx.vocab_start)
        return grad, None, None, None, None, None


def token_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group: ProcessGroup | None = None,
    vocab_start: int = 0,
    ignore_index: int = IGNORE_INDEX,
    chunk_elements: int | None = None,
) -> torch.Tensor:
    """log p(label) per token, in fp32, with its gradient (0 where `labels == ignore_index`). `logits`: (..., V_local)
    holding ids [vocab_start, vocab_start + V_local) of the vocabulary split over `group`; `labels`: (...), already
    aligned with the logits (shift them first for a causal LM). Chunked over tokens (`chunk_elements` logits a
    chunk): kept for backward are the logits themselves and one number per token."""
    flat, targets = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).to(logits.device)
    chunk = chunk_tokens(flat.shape[-1], chunk_elements)
    log_probs = _ChunkedLogProbs.apply(flat, targets, group, vocab_start, ignore_index, chunk)
    return log_probs.reshape(labels.shape)


@torch.no_grad()
def token_statistics(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group: ProcessGroup | None = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_elements: int | None = None,
) -> TokenStatistics:
    """Entropy, argmax correctness, mean logit, log p(label) and log sum p^2 per token of vocab-parallel `logits` (see
    `token_log_probs` for the arguments; `vocab_size`: the whole vocabulary, default V_local when `group` is None).
    Two all-reduces over `group` of O(tokens) numbers per chunk of tokens: the maxima, then the sums."""
    flat, targets = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).to(logits.device)
    n, local = flat.shape
    scores = _empty_scores(n, flat.device)
    ignored = targets == ignore_index
    chunk = chunk_tokens(local, chunk_elements)
    for start in range(0, n, chunk):
        span = slice(start, min(start + chunk, n))
        scored = _score_chunk(_chunk_of(flat, span), targets[span], group, vocab_start, statistics=True)
        _fill(scores, span, scored, ignored[span], vocab_size or local)
    return _statistics_of(scores, labels.shape)


def _statistics_of(scores: dict, shape: torch.Size) -> TokenStatistics:
    return TokenStatistics(
        entropy=scores["entropy"].reshape(shape),
        correct=scores["correct"].reshape(shape),
        mean_logit=scores["mean_logit"].reshape(shape),
        log_prob=scores["log_prob"].reshape(shape),
        log_sum_sq_probs=scores["sq"].reshape(shape),
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


# ------------------------------------------------------------------------------ hidden states and the head


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype of the projection: autocast's where it is on (as the model's own head would run), else the weight's."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def _project(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
    """fp32 logits hidden @ weight^T + bias, the product in `dtype` (outside autocast: the same in both passes)."""
    with torch.autocast(hidden.device.type, enabled=False):
        return F.linear(hidden.to(dtype), weight, bias).to(torch.float32)


class _ChunkedHead(torch.autograd.Function):
    """Per-token scores of `transform(hidden @ weight^T + bias)`, chunk by chunk of tokens, never the (N, V_local)
    logits (see `docs/module_notes.md`); differentiable in the log-probabilities only. Saved for backward: the inputs
    and log Z per token; backward projects each chunk again."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, group, vocab_start, vocab_size, transform, ignore_index, chunk):
        ctx.set_materialize_grads(False)
        n = hidden.shape[0]
        dtype = _compute_dtype(hidden, weight)
        cast_weight = weight.to(dtype)
        cast_bias = bias.to(dtype) if bias is not None else None
        scores = _empty_scores(n, hidden.device)
        ignored = target == ignore_index
        for start in range(0, n, chunk):
            span = slice(start, min(start + chunk, n))
            z = transform.apply_(_project(hidden[span], cast_weight, cast_bias, dtype))
            scored = _score_chunk(z, target[span], group, vocab_start, statistics=True)
            del z
            _fill(scores, span, scored, ignored[span], vocab_size)
        ctx.save_for_backward(hidden, weight, bias, target, scores["log_z"], ignored)
        ctx.dtype, ctx.transform, ctx.vocab_start, ctx.chunk = dtype, transform, vocab_start, chunk
        outputs = scores["log_prob"], scores["entropy"], scores["mean_logit"], scores["sq"], scores["correct"]
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx, grad_log_prob, *_):
        hidden, weight, bias, target, log_z, ignored = ctx.saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        if grad_log_prob is None or not (needs_hidden or needs_weight or needs_bias):
            return (None,) * 10
        transform, dtype = ctx.transform, ctx.dtype
        scale = grad_log_prob.float().masked_fill(ignored, 0.0)
        cast_weight = weight.to(dtype)
        cast_bias = bias.to(dtype) if bias is not None else None
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if needs_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if needs_bias else None
        factor = transform.scale / transform.temperature  # d z / d y without the softcap
        n = hidden.shape[0]
        for start in range(0, n, ctx.chunk):
            span = slice(start, min(start + ctx.chunk, n))
            y = _project(hidden[span], cast_weight, cast_bias, dtype)
            if transform.softcap is None:
                z = transform.apply_(y)
                tanh = None
            else:  # z = softcap * tanh(scale * y / softcap) / temperature
                tanh = y.mul_(transform.scale / transform.softcap).tanh_()
                z = tanh * (transform.softcap / transform.temperature)
            grad = _log_prob_grad_(z, target[span], log_z[span], scale[span], ctx.vocab_start)
            if tanh is not None:
                grad.mul_(tanh.square_().neg_().add_(1.0))
                del tanh
            if factor != 1.0:
                grad.mul_(factor)
            grad = grad.to(dtype)
            chunk_hidden = hidden[span].to(dtype)
            if grad_hidden is not None:
                grad_hidden[span] = (grad @ cast_weight).to(torch.float32)
            if grad_weight is not None and dtype == torch.float32:
                grad_weight.addmm_(grad.t(), chunk_hidden)  # no V_local x H temporary
            elif grad_weight is not None:
                grad_weight.add_((grad.t() @ chunk_hidden).to(torch.float32))
            if grad_bias is not None:
                grad_bias.add_(grad.sum(0, dtype=torch.float32))
            del grad, z, y
        return (
            grad_hidden.to(hidden.dtype) if grad_hidden is not None else None,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            grad_bias.to(bias.dtype) if grad_bias is not None else None,
            *(None,) * 7,
        )


def head_token_scores(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    group: ProcessGroup | None = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    transform: LogitTransform | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_elements: int | None = None,
) -> TokenStatistics:
    """The per-token numbers of `token_statistics` for the logits `transform(hidden @ weight^T + bias)`, computed a
    chunk of tokens at a time without ever holding those logits (see `docs/module_notes.md`). `hidden`: (..., H), as
    this rank's slice of the LM head reads it (whole under tp, sequence parallelism gathered); `weight` (V_local, H)
    and `bias`: that slice, vocabulary ids [vocab_start, vocab_start + V_local) of `vocab_size` split over `group`;
    `labels`: (...), aligned with `hidden`. `log_prob` carries the gradient into `hidden`, `weight` and `bias` (the
    hidden states' is this rank's part: the tp region's entry sums it); the other fields have none. `transform`:
    default none (the logits as projected)."""
    shape = labels.shape
    flat = hidden.reshape(-1, hidden.shape[-1])
    targets = labels.reshape(-1).to(hidden.device)
    chunk = chunk_tokens(weight.shape[0], chunk_elements)
    vocab_size = vocab_size or weight.shape[0]
    log_prob, entropy, mean_logit, sq, correct = _ChunkedHead.apply(
        flat, weight, bias, targets, group, vocab_start, vocab_size, transform or LogitTransform(), ignore_index, chunk
    )
    return TokenStatistics(
        entropy=entropy.reshape(shape),
        correct=correct.reshape(shape),
        mean_logit=mean_logit.reshape(shape),
        log_prob=log_prob.reshape(shape),
        log_sum_sq_probs=sq.reshape(shape),
    )
