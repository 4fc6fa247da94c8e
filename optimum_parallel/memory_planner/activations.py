"""Activation bytes per micro-batch: Korthikanti et al. 2022 and the same counting for this engine's Llama.

One implementation for the memory planner and scripts/bench_memory.py: per layer `paper_layer_*` / `llama_layer_*`
(`*_terms` per s*b*h element, `*_bytes` in bytes), outside the layers `*_outside_bytes`, under cp
`ring_attention_layer_bytes`, and `activation_bytes` by method, all over the sizes of `Dims`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Dims:
    """The paper's symbols: s sequence, b micro-batch, h hidden, a heads, v vocabulary; i MLP size, g = kv/a."""

    s: int
    b: int
    h: int
    a: int
    v: int
    i: int
    g: float
    head_dim: int

    @property
    def sbh(self) -> int:
        return self.s * self.b * self.h

    @classmethod
    def from_config(cls, config, s: int = 0, b: int = 0) -> Dims:
        """The sizes of a transformers config (its text config for multimodal ones), whatever it names them."""
        c = config.get_text_config() if hasattr(config, "get_text_config") else config
        h = _first(c, "hidden_size", "n_embd", "d_model")
        a = _first(c, "num_attention_heads", "n_head", "num_heads")
        kv = getattr(c, "num_key_value_heads", None) or a
        i = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or getattr(c, "d_ff", None) or 4 * h
        head_dim = getattr(c, "head_dim", None) or h // a
        return cls(s=s, b=b, h=h, a=a, v=c.vocab_size, i=i, g=kv / a, head_dim=head_dim)


# --------------------------------------------------------------------------------------------------------------
# Korthikanti et al. 2022


def _paper_terms_16bit(d: Dims, tp: int, sp: bool) -> tuple[float, float]:
    linear = 34 / tp if sp or tp == 1 else 10 + 24 / tp
    return linear, 5 * d.a * d.s / (d.h * tp)


def paper_layer_terms(d: Dims, tp: int, sp: bool, element: int) -> tuple[float, float]:
    """Korthikanti et al. 2022, bytes per s*b*h of one layer at `element` bytes: (s*b*h term, 5as/h score term)."""
    linear, scores = _paper_terms_16bit(d, tp, sp)
    return linear * element / 2, scores * element / 2


def paper_layer_bytes(d: Dims, tp: int, sp: bool, element: int) -> float:
    """Korthikanti et al. 2022, one transformer layer, scaled from 16-bit to `element` bytes."""
    linear, scores = _paper_terms_16bit(d, tp, sp)
    return d.sbh * (linear + scores) * element / 2


def paper_outside_bytes(d: Dims, tp: int, sp: bool, element: int) -> tuple[float, float]:
    """The paper's activations outside the layers: (first stage: embedding, last stage: norm, head input and the
    fp32 cross-entropy), i.e. 4sbh(1 + v/h)/t in total at 16 bits (the sbh part not split without SP)."""
    split = tp if sp else 1
    return d.sbh * element / 2 / split, 3 * d.sbh * element / 2 / split + 4 * d.s * d.b * d.v / tp


# --------------------------------------------------------------------------------------------------------------
# Llama


def llama_layer_terms(
    d: Dims, tp: int, sp: bool, element: int, attention: str, whole_inputs: bool = True
) -> tuple[float, float]:
    """One Llama decoder layer as this engine runs it (transformers' code), bytes per s*b*h saved for backward:
    (the s*b*h term, the score term).

    Norms keep an fp32 copy of their input and the normalised output (4 + e bytes per element each); the q/k/v
    and gate/up inputs are saved whole, also under SP (the column-parallel layers save their all-gathered
    input; `whole_inputs=False` gives Megatron's ideal, which keeps only the sequence slice and divides them by
    tp too); q, k, v, the attention output and the 4 MLP tensors (SiLU in/out, up out, down in) are split;
    scores: eager keeps the fp32 softmax (and its cast for 16-bit), sdpa a fp32 log-sum-exp of b*a*s.
    """
    e = element
    seq_split = tp if sp else 1
    norms = 2 * (4 + e) / seq_split
    inputs = 2 * e / (1 if whole_inputs else seq_split)
    split = (e * (1 + 2 * d.g) + e + 4 * e * d.i / d.h) / tp
    if attention == "eager":
        scores = (4 + (e if e != 4 else 0)) * d.a * d.s / d.h / tp
    else:
        scores = 4 * d.a / d.h / tp
    return norms + inputs + split, scores


def llama_layer_bytes(d: Dims, tp: int, sp: bool, element: int, attention: str) -> float:
    """One Llama decoder layer as this engine runs it, in bytes (see `llama_layer_terms`)."""
    return d.sbh * sum(llama_layer_terms(d, tp, sp, element, attention))


def llama_outside_bytes(d: Dims, tp: int, sp: bool, element: int) -> tuple[float, float]:
    """(first stage: RoPE cos/sin, last stage: final norm, LM-head input (whole), fp32 vocab-parallel softmax)."""
    rope = 2 * d.s * d.head_dim * element
    last = d.sbh * ((4 + element) / (tp if sp else 1) + element) + 4 * d.s * d.b * d.v / tp
    return rope, last


def ring_attention_layer_bytes(d: Dims, cp: int, tp: int, element: int) -> float:
    """Ring attention's extra bytes per layer at context-parallel size `cp` (0 at cp=1): the K and V blocks in
    flight. Each step computes on one K/V pair while receiving the next: 2 extra blocks x (K, V) x b x s/cp tokens x
    this rank's kv heads (split over tp, at least one when tp replicates them) x head_dim."""
    if cp == 1:
        return 0.0
    kv_heads = max(1.0, d.g * d.a / tp)
    return 2 * 2 * d.b * (d.s / cp) * kv_heads * d.head_dim * element


def activation_bytes(
    method: str, d: Dims, tp: int, sp: bool, element: int, attention: str
) -> tuple[float, float, float]:
    """Bytes of one layer, and those the first and the last pipeline stage hold outside the layers, by `method`
    ('paper' or 'llama')."""
    if method == "paper":
        return paper_layer_bytes(d, tp, sp, element), *paper_outside_bytes(d, tp, sp, element)
    return llama_layer_bytes(d, tp, sp, element, attention), *llama_outside_bytes(d, tp, sp, element)


def _first(config, *names: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"{type(config).__name__} has none of {', '.join(names)}; cannot size the activations")
