"""Attention between chunks of one sequence, returning the log-sum-exp so partial results merge exactly.

`Attend` (with `Spans`, `Blocks` and a packed row's `packed.Documents`) classifies every (query chunk, key chunk) pair
and builds its mask; `attend_chunks` / `attend_chunks_backward` run the visible pairs, `merge` joins partial results
and `add_sinks` / `sinks_grad` add attention sinks. Design notes: docs/module_notes.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..mesh import device as devices

if TYPE_CHECKING:
    from .packed import Documents

NEG_INF = float("-inf")
_QUERY_TILE = 1024  # rows of the plain-tensor path's score tile


def _ends(ids: torch.Tensor, chunk: int) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """Per row and chunk, the id of its first and of its last token (on the host, once per forward)."""
    host = ids.cpu()
    return tuple(map(tuple, host[:, ::chunk].tolist())), tuple(map(tuple, host[:, chunk - 1 :: chunk].tolist()))


def _pair(ids: torch.Tensor, q_chunk: int, k_chunk: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    return ids[:, q_chunk * chunk : (q_chunk + 1) * chunk], ids[:, k_chunk * chunk : (k_chunk + 1) * chunk]


@dataclass(frozen=True)
class Spans:
    """A query sees keys of its own span only (llama4's chunked attention: spans of `attention_chunk_size` tokens
    counted from each row's first real token, or from each packed document's positions). `ids` (rows, length): every
    token's span, non-decreasing along a row; `first` / `last`: per row and chunk, the span of its first / last
    token."""

    ids: torch.Tensor
    first: tuple[tuple[int, ...], ...]
    last: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, ids: torch.Tensor, chunk: int) -> Spans:
        return cls(ids, *_ends(ids, chunk))

    def visibility(self, q_chunk: int, k_chunk: int) -> str:
        """'none' when no query of one chunk shares a span with a key of the other, 'inside' when every row's two
        chunks lie in one span, else 'mixed'."""
        early, late = min(q_chunk, k_chunk), max(q_chunk, k_chunk)
        rows = range(len(self.first))
        if early != late and not any(self.last[row][early] == self.first[row][late] for row in rows):
            return "none"
        if all(self.first[row][early] == self.last[row][late] for row in rows):
            return "inside"
        return "mixed"

    def same(self, q_chunk: int, k_chunk: int, chunk: int) -> torch.Tensor:
        """(rows, 1, chunk, chunk) bool: query and key in one span."""
        q, k = _pair(self.ids, q_chunk, k_chunk, chunk)
        return (q[:, :, None] == k[:, None, :])[:, None]


@dataclass(frozen=True)
class Blocks:
    """The tokens of one block (Gemma 3: one image's tokens, from `token_type_ids`) see each other both ways, earlier
    keys and later ones. `ids` (batch, length): every token's block, -1 outside any; `first` / `last`: per row and
    chunk, the block of its first / last token; `inner`: per chunk, whether some row holds two tokens of one block in
    it (its diagonal pair is then no longer causal)."""

    ids: torch.Tensor
    first: tuple[tuple[int, ...], ...]
    last: tuple[tuple[int, ...], ...]
    inner: tuple[bool, ...]

    @classmethod
    def of(cls, ids: torch.Tensor, chunk: int) -> Blocks:
        rows, length = ids.shape
        follows = torch.zeros(rows, length, dtype=torch.bool, device=ids.device)
        follows[:, :-1] = (ids[:, 1:] == ids[:, :-1]) & (ids[:, :-1] >= 0)  # token i and i + 1 in one block
        inner = follows.view(rows, length // chunk, chunk)[:, :, :-1].any(-1).any(0)
        return cls(ids, *_ends(ids, chunk), tuple(inner.tolist()))

    def reaches(self, q_chunk: int, k_chunk: int) -> bool:
        """For a later key chunk: whether some row's block runs from the query chunk into it (blocks are runs of
        consecutive tokens, so it holds the query chunk's last token and the key chunk's first)."""
        return any(
            last[q_chunk] >= 0 and last[q_chunk] == first[k_chunk]
            for first, last in zip(self.first, self.last, strict=True)
        )

    def same(self, q_chunk: int, k_chunk: int, chunk: int) -> torch.Tensor:
        """(batch, 1, chunk, chunk) bool: query and key in one block."""
        q, k = _pair(self.ids, q_chunk, k_chunk, chunk)
        return ((q[:, :, None] == k[:, None, :]) & (q[:, :, None] >= 0))[:, None]


@dataclass(frozen=True)
class Attend:
    """What every pair shares: the scale, the window (keys with q - k >= window are hidden), the soft cap, the key
    padding mask of the whole sequence ((batch, seq) bool, True = a real token, or None), a packed row's documents,
    llama4's attention-chunk spans and Gemma 3's image blocks (or None)."""

    chunk: int
    scale: float
    window: int | None
    softcap: float | None
    key_mask: torch.Tensor | None
    documents: Documents | None = None  # a packed row: which tokens share a document (packed.py)
    spans: Spans | None = None
    blocks: Blocks | None = None

    def visibility(self, q_chunk: int, k_chunk: int) -> str:
        """'none', 'full', 'causal' (the diagonal, no window inside) or 'masked' for a pair of chunk indices."""
        if k_chunk > q_chunk:  # a later chunk: seen only through a block both share
            if self.blocks is None or not self.blocks.reaches(q_chunk, k_chunk):
                return "none"
            kind = "masked"
        elif k_chunk == q_chunk:
            kind = "masked" if self.blocks is not None and self.blocks.inner[q_chunk] else "causal"
        else:
            kind = "full"
        for rule in (self.documents, self.spans):  # 'none', 'inside' or 'mixed'
            shared = "inside" if rule is None else rule.visibility(q_chunk, k_chunk)
            if shared == "none":
                return "none"
            if shared == "mixed":
                kind = "masked"
        c, w = self.chunk, self.window
        if w is not None and k_chunk <= q_chunk:  # the window hides earlier keys only
            nearest = (q_chunk - k_chunk - 1) * c + 1 if k_chunk < q_chunk else 0
            farthest = (q_chunk - k_chunk) * c + c - 1
            if nearest >= w:
                return "none"
            if farthest >= w:
                kind = "masked"
        if self.key_mask is not None and not bool(self._keys(k_chunk).all()):
            return "masked"
        return kind

    def _keys(self, k_chunk: int) -> torch.Tensor:
        return self.key_mask[:, k_chunk * self.chunk : (k_chunk + 1) * self.chunk]

    def mask(self, q_chunk: int, k_chunk: int, device) -> torch.Tensor:
        """(batch or 1, 1, chunk, chunk) bool, True = visible."""
        c = self.chunk
        q = torch.arange(q_chunk * c, (q_chunk + 1) * c, device=device)[:, None]
        k = torch.arange(k_chunk * c, (k_chunk + 1) * c, device=device)[None, :]
        visible = (k <= q)[None, None]
        if self.blocks is not None:
            visible = visible | self.blocks.same(q_chunk, k_chunk, c).to(device)
        if self.window is not None:
            visible = visible & (q - k < self.window)
        if self.key_mask is not None:
            visible = visible & self._keys(k_chunk).to(device)[:, None, None, :]
        if self.documents is not None:
            visible = visible & self.documents.same_document(q_chunk, k_chunk).to(device)
        if self.spans is not None:
            visible = visible & self.spans.same(q_chunk, k_chunk, c).to(device)
        return visible


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics and gradients accumulate in fp32 at least (fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def _fold_kv_grad(grad: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // groups, groups, s, d).sum(2)


def _additive(visible: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if visible is None:
        return None
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, NEG_INF)


def _fused(attend: Attend) -> bool:
    return attend.softcap is None and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def pair_forward(q, k, v, kind: str, visible, attend: Attend, use_fused: bool):
    """(out, lse) of queries q (b, h, c, d) over keys k, v (b, h, c, d); lse is -inf on rows that see nothing."""
    if use_fused and devices.is_host(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, kind == "causal", attn_mask=_additive(visible, q.dtype), scale=attend.scale
        )
        lse = lse.to(accumulation_dtype(q.dtype))
    else:
        out, lse = _plain_forward(q, k, v, kind, visible, attend)
    if visible is not None:  # the fused kernel reports lse = 0 on a row with no visible key
        lse = lse.masked_fill(~visible.any(-1), NEG_INF)
    return out, lse


def pair_backward(dout, q, k, v, out, lse, kind: str, visible, attend: Attend, use_fused: bool):
    """(dq, dk, dv) of one pair given the MERGED output and log-sum-exp of its query rows (rows that see
    nothing anywhere carry lse = -inf and get zero gradients)."""
    safe_lse = lse.masked_fill(lse == NEG_INF, 0.0)
    if use_fused and devices.is_host(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, safe_lse.to(lse.dtype), 0.0, kind == "causal",
            attn_mask=_additive(visible, q.dtype), scale=attend.scale,
        )  # fmt: skip
    return _plain_backward(dout, q, k, v, out, safe_lse, kind, visible, attend)


def _scores(q, k, kind, visible, attend: Attend, rows: slice):
    """Scaled (soft-capped) scores of query rows `rows`, masked with -inf; and tanh for the cap's derivative."""
    acc = accumulation_dtype(q.dtype)
    scores = torch.matmul(q[:, :, rows].to(acc), k.to(acc).transpose(-1, -2)) * attend.scale
    capped = None
    if attend.softcap is not None:
        capped = torch.tanh(scores / attend.softcap)
        scores = capped * attend.softcap
    if kind == "causal":
        c = k.shape[2]
        r = torch.arange(rows.start, rows.stop, device=q.device)[:, None]
        scores = scores.masked_fill(torch.arange(c, device=q.device)[None, :] > r, NEG_INF)
    elif visible is not None:
        scores = scores.masked_fill(~visible[:, :, rows], NEG_INF)
    return scores, capped


def _tiles(length: int):
    for start in range(0, length, _QUERY_TILE):
        yield slice(start, min(start + _QUERY_TILE, length))


def _plain_forward(q, k, v, kind, visible, attend: Attend):
    outs, lses = [], []
    for rows in _tiles(q.shape[2]):
        scores, _ = _scores(q, k, kind, visible, attend, rows)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.masked_fill(lse == NEG_INF, 0.0)[..., None])
        outs.append(torch.matmul(probs, v.to(probs.dtype)).to(q.dtype))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _plain_backward(dout, q, k, v, out, lse, kind, visible, attend: Attend):
    acc = accumulation_dtype(q.dtype)
    dq, dk, dv = (torch.zeros_like(t, dtype=acc) for t in (q, k, v))
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # rowsum(dO * O): the softmax backward's correction
    for rows in _tiles(q.shape[2]):
        scores, capped = _scores(q, k, kind, visible, attend, rows)
        probs = torch.exp(scores - lse[:, :, rows, None])
        d_out = dout[:, :, rows].to(acc)
        dv += torch.matmul(probs.transpose(-1, -2), d_out)
        d_scores = probs * (torch.matmul(d_out, v.to(acc).transpose(-1, -2)) - delta[:, :, rows, None])
        if capped is not None:  # d(cap * tanh(s / cap)) / ds = 1 - tanh^2
            d_scores = d_scores * (1 - capped * capped)
        d_scores = d_scores * attend.scale
        dq[:, :, rows] = torch.matmul(d_scores, k.to(acc))
        dk += torch.matmul(d_scores.transpose(-1, -2), q[:, :, rows].to(acc))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def merge(out, lse, block_out, block_lse):
    """Merge two partial attentions of the same query rows by their log-sum-exps (either may be None)."""
    if out is None:
        return block_out, block_lse
    if block_out is None:
        return out, lse
    new_lse = torch.logaddexp(lse, block_lse)
    safe = new_lse.masked_fill(new_lse == NEG_INF, 0.0)
    old_weight = torch.exp(lse - safe)[..., None].to(out.dtype)
    new_weight = torch.exp(block_lse - safe)[..., None].to(out.dtype)
    return out * old_weight + block_out * new_weight, new_lse


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head's sink logit (gpt_oss's `s_aux`: (heads,)) joins the softmax's denominator once every pair is
    merged: the output is scaled by exp(lse) / (exp(lse) + exp(sink)) and the log-sum-exp becomes logaddexp(lse,
    sink). The backward of the pairs, given this output and log-sum-exp, is then the exact one (the sink is a key whose
    value is zero); the sinks' own gradient is `sinks_grad`."""
    total = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None].expand_as(lse))
    return out * torch.exp(lse - total)[..., None].to(out.dtype), total


def sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sink of each head over these query rows: -sum over rows of p_sink * rowsum(dout * out), p_sink =
    exp(sink - lse), with `out` and `lse` as `add_sinks` returned them."""
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1)
    sink_weight = torch.exp(sinks.to(acc)[None, :, None] - lse)
    return -(sink_weight * delta).sum((0, 2)).to(sinks.dtype)


def chunk_of(x: torch.Tensor, index: int, chunk: int) -> torch.Tensor:
    return x.narrow(2, index * chunk, chunk)


def visible_pairs(q_chunks, k_chunks, attend: Attend, device):
    """(i, j, kind, mask) for every pair of query chunk i and key chunk j that some query sees (mask only for
    the 'masked' kind); indices are positions in `q_chunks` / `k_chunks`."""
    for i, qc in enumerate(q_chunks):
        for j, kc in enumerate(k_chunks):
            kind = attend.visibility(qc, kc)
            if kind != "none":
                yield i, j, kind, attend.mask(qc, kc, device) if kind == "masked" else None


def attend_chunks(q, k, v, q_chunks, k_chunks, attend: Attend, groups: int):
    """Partial attention of the query chunks (ids `q_chunks`, laid side by side in q) over the key chunks (ids
    `k_chunks` in k, v): per query chunk its (out, lse), or (None, None) when it sees none of them."""
    use_fused, c = _fused(attend), attend.chunk
    results: list = [(None, None)] * len(q_chunks)
    for i, j, kind, visible in visible_pairs(q_chunks, k_chunks, attend, q.device):
        keys, values = (_repeat_kv(chunk_of(t, j, c), groups) for t in (k, v))
        block = pair_forward(chunk_of(q, i, c), keys, values, kind, visible, attend, use_fused)
        results[i] = merge(*results[i], *block)
    return results


def attend_chunks_backward(dout, q, k, v, out, lse, q_chunks, k_chunks, attend: Attend, groups: int):
    """Gradients of the pairs (q_chunks x k_chunks): dq for q's rows, dk and dv for k's rows (heads folded back
    to k's), given the merged output and log-sum-exp of q's rows."""
    use_fused, c = _fused(attend), attend.chunk
    dq, dk, dv = (torch.zeros_like(t, dtype=accumulation_dtype(q.dtype)) for t in (q, k, v))
    for i, j, kind, visible in visible_pairs(q_chunks, k_chunks, attend, q.device):
        keys, values = (_repeat_kv(chunk_of(t, j, c), groups) for t in (k, v))
        rows = (chunk_of(dout, i, c), chunk_of(q, i, c))
        grads = pair_backward(
            *rows, keys, values, chunk_of(out, i, c), lse.narrow(2, i * c, c), kind, visible, attend, use_fused
        )
        chunk_of(dq, i, c).add_(grads[0])
        chunk_of(dk, j, c).add_(_fold_kv_grad(grads[1], groups))
        chunk_of(dv, j, c).add_(_fold_kv_grad(grads[2], groups))
    return dq, dk, dv


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
