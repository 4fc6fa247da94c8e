"""Tensor-parallel plans derived from a model's structure for what transformers' `base_model_tp_plan` leaves whole:
state-space and linear-attention mixers, short convolutions, and plain attention / MLP blocks.

`mixer_plan` gives regex -> style entries; `merge_mixer_plan` adds them to a translated tp plan; `check_mixers` raises,
before anything moves, when tp cannot split a mixer's heads; `mixers_left_whole` says which mixers stay whole and why.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from torch import nn

from ..plan.wrappers import style_target
from ..styles import (
    ColWiseParallel,
    PackedColWiseParallel,
    ParallelStyle,
    ReplicatedWithGradAllReduce,
    RowWiseParallel,
    SplitParameter,
    optional,
)
from ..styles.conv import DepthwiseConvParallel
from ..styles.mixer import (
    AllReduceOutputGradient,
    EnteredColWiseParallel,
    LocalAttributes,
    LocalConfigAttributes,
    SplitBuffer,
)

Entries = dict[str, list[ParallelStyle]]  # child name (relative, "" for the module itself) -> styles
Recogniser = Callable[[nn.Module, int | None], "tuple[Entries | None, str] | None"]


def _linear(module: nn.Module, name: str) -> nn.Linear | None:
    """The Linear `name`, also when an adapter wraps it (PEFT's LoRA added before the plan): the plan splits the
    wrapped layer, so a mixer is recognised whatever its projections carry."""
    child = getattr(module, name, None)
    child = style_target(child) if isinstance(child, nn.Module) else child
    return child if isinstance(child, nn.Linear) else None


def _depthwise(module: nn.Module, name: str) -> nn.Conv1d | None:
    conv = getattr(module, name, None)
    if isinstance(conv, nn.Conv1d) and conv.groups == conv.in_channels == conv.out_channels:
        return conv
    return None


def _param(module: nn.Module, name: str):
    return module._parameters.get(name)


def _has_weight(module: nn.Module | None) -> bool:
    return module is not None and any(p is not None for p in module._parameters.values())


def _int(module: nn.Module, name: str) -> int | None:
    value = getattr(module, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _divides(units: int, tp: int | None) -> bool:
    return tp is None or units % tp == 0


def _norm_groups(norm: nn.Module, width: int) -> int:
    """The groups a gated norm over `width` features normalizes separately (`n_groups`, or `group_size` wide; 1: the
    whole width at once)."""
    groups, size = _int(norm, "n_groups"), _int(norm, "group_size")
    if groups:
        return groups
    return width // size if size and width % size == 0 else 1


def _mamba2(module: nn.Module, tp: int | None):
    """Mamba2-style mixer: in_proj [z | x | B | C | dt], conv1d over [x | B | C], per-head A_log / D / dt_bias."""
    in_proj, out_proj, conv = _linear(module, "in_proj"), _linear(module, "out_proj"), _depthwise(module, "conv1d")
    heads, head_dim, groups, state = (_int(module, a) for a in ("num_heads", "head_dim", "n_groups", "ssm_state_size"))
    inner = _int(module, "intermediate_size")
    a_log = _param(module, "A_log")
    if None in (in_proj, out_proj, conv, heads, head_dim, groups, state, inner, a_log) or a_log.dim() != 1:
        return None
    bc = groups * state
    if in_proj.out_features != 2 * inner + 2 * bc + heads or conv.out_channels != inner + 2 * bc:
        return None
    norm = getattr(module, "norm", None)
    gated_norm = _has_weight(norm)
    norm_groups = _norm_groups(norm, inner) if gated_norm else None
    if norm_groups is not None and tp is not None and norm_groups % tp:
        reason = f"its gated norm normalizes over {norm_groups} group(s) of heads, which tp={tp} does not divide"
        return None, reason
    parts, units = [inner, inner, bc, bc, heads], [heads, heads, groups, groups, heads]
    entries: Entries = {
        "in_proj": [PackedColWiseParallel(parts, units)],
        "conv1d": [DepthwiseConvParallel([inner, bc, bc], [heads, groups, groups])],
        "out_proj": [RowWiseParallel(units=heads)],
    }
    own: list[ParallelStyle] = [
        SplitParameter(p, 0, heads) for p in ("A_log", "D", "dt_bias") if _param(module, p) is not None
    ]
    if isinstance(module._buffers.get("mup_vector"), object) and module._buffers.get("mup_vector") is not None:
        own.append(SplitBuffer("mup_vector", -1, parts, units))
    attrs = {
        "num_heads": [(heads, 1)],
        "intermediate_size": [(heads, head_dim)],
        "n_groups": [(groups, 1)],
        "conv_dim": [(heads, head_dim), (groups, 2 * state)],
    }
    for extra in ("groups_time_state_size",):
        if _int(module, extra) == bc:
            attrs[extra] = [(groups, state)]
    if norm_groups is not None:
        entries["norm"] = [SplitParameter("weight", 0, norm_groups)]
        if _int(norm, "n_groups") is not None:  # (a `group_size` norm finds its local groups from its input)
            entries["norm"].append(LocalAttributes({"n_groups": [(norm_groups, 1)]}))
    entries[""] = [*own, LocalAttributes(attrs)]
    return entries, ""


def _mamba1(module: nn.Module, tp: int | None):
    """Mamba1 mixer: in_proj [x | z], conv1d over x, x_proj -> dt | B | C, dt_proj, A_log [channels, state], D."""
    in_proj, x_proj, dt_proj = _linear(module, "in_proj"), _linear(module, "x_proj"), _linear(module, "dt_proj")
    out_proj, conv, inner = _linear(module, "out_proj"), _depthwise(module, "conv1d"), _int(module, "intermediate_size")
    a_log = _param(module, "A_log")
    if None in (in_proj, x_proj, dt_proj, out_proj, conv, inner, a_log) or a_log.dim() != 2:
        return None
    if in_proj.out_features != 2 * inner or conv.out_channels != inner or dt_proj.out_features != inner:
        return None
    entries: Entries = {
        "in_proj": [PackedColWiseParallel(2)],
        "conv1d": [DepthwiseConvParallel()],
        "x_proj": [RowWiseParallel(), AllReduceOutputGradient()],
        "dt_proj": [SplitParameter("weight", 0)] + ([SplitParameter("bias", 0)] if dt_proj.bias is not None else []),
        "out_proj": [RowWiseParallel()],
        "": [SplitParameter("A_log", 0), SplitParameter("D", 0), LocalAttributes({"intermediate_size": [(inner, 1)]})],
    }
    for norm in ("dt_layernorm", "b_layernorm", "c_layernorm"):
        if _has_weight(getattr(module, norm, None)):
            entries[norm] = [ReplicatedWithGradAllReduce()]
    return entries, ""


def _gated_delta_net(module: nn.Module, tp: int | None):
    """Gated delta net: in_proj_qkv [q | k | v] with in_proj_z / in_proj_b / in_proj_a (Qwen3.5), or in_proj_qkvz and
    in_proj_ba interleaved per key head ([q_h | k_h | v_h.. | z_h..], Qwen3-Next: split in whole key heads)."""
    conv, out = _depthwise(module, "conv1d"), _linear(module, "out_proj")
    k_heads, v_heads = _int(module, "num_k_heads"), _int(module, "num_v_heads")
    k_dim, v_dim = _int(module, "head_k_dim"), _int(module, "head_v_dim")
    if None in (conv, out, k_heads, v_heads, k_dim, v_dim):
        return None
    key, value = k_heads * k_dim, v_heads * v_dim
    separate = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    if all(_linear(module, n) is not None for n in separate):
        entries: Entries = {
            "in_proj_qkv": [PackedColWiseParallel([key, key, value], [k_heads, k_heads, v_heads])],
            "in_proj_z": [ColWiseParallel(units=v_heads)],
            "in_proj_b": [ColWiseParallel(units=v_heads)],
            "in_proj_a": [ColWiseParallel(units=v_heads)],
        }
    elif _linear(module, "in_proj_qkvz") is not None and _linear(module, "in_proj_ba") is not None:
        entries = {"in_proj_qkvz": [ColWiseParallel(units=k_heads)], "in_proj_ba": [ColWiseParallel(units=k_heads)]}
    else:
        return None
    entries["conv1d"] = [DepthwiseConvParallel([key, key, value], [k_heads, k_heads, v_heads])]
    entries["out_proj"] = [RowWiseParallel(units=v_heads)]
    if _has_weight(getattr(module, "norm", None)):
        entries["norm"] = [ReplicatedWithGradAllReduce()]  # over one head's features: sees only this rank's heads
    attrs = {
        "num_k_heads": [(k_heads, 1)],
        "num_v_heads": [(v_heads, 1)],
        "key_dim": [(k_heads, k_dim)],
        "value_dim": [(v_heads, v_dim)],
        "conv_dim": [(k_heads, 2 * k_dim), (v_heads, v_dim)],
    }
    entries[""] = [SplitParameter(p, 0, v_heads) for p in ("A_log", "dt_bias") if _param(module, p) is not None]
    entries[""].append(LocalAttributes({k: v for k, v in attrs.items() if _int(module, k) is not None}))
    return entries, ""


def _delta_attention(module: nn.Module, tp: int | None):
    """Kimi's delta attention: q/k/v_proj, conv1d over [q | k | v], forget_gate, b_proj, g_a_proj -> g_b_proj."""
    projections = ("q_proj", "k_proj", "v_proj", "b_proj", "g_b_proj", "o_proj")
    q, k, v, b, g_b, o = (_linear(module, n) for n in projections)
    conv, gate = _depthwise(module, "conv1d"), getattr(module, "forget_gate", None)
    heads, head_dim = _int(module, "num_heads"), _int(module, "head_dim")
    if None in (q, k, v, b, g_b, o, conv, gate, heads, head_dim) or _linear(gate, "f_b_proj") is None:
        return None
    width = heads * head_dim
    entries: Entries = {name: [ColWiseParallel(units=heads)] for name in projections[:-2]}
    entries["conv1d"] = [DepthwiseConvParallel([width] * 3, [heads] * 3)]
    entries["o_proj"] = [RowWiseParallel(units=heads)]
    # the low-rank gates stay whole, their output gradient summed over tp once (every head reads them), so the split
    # up-projections after them take no entry of their own: the same under sequence parallelism's gathered block
    for low_rank, up in (("g_a_proj", "g_b_proj"), ("forget_gate.f_a_proj", "forget_gate.f_b_proj")):
        entries[up] = [EnteredColWiseParallel(units=heads)]
        if isinstance(module.get_submodule(low_rank), nn.Linear):
            entries[low_rank] = [AllReduceOutputGradient()]
    gate_params = [SplitParameter("dt_bias", 0, heads)] if _param(gate, "dt_bias") is not None else []
    a_log = _param(gate, "A_log")
    if a_log is not None:
        gate_params.append(SplitParameter("A_log", next(d for d, n in enumerate(a_log.shape) if n == heads), heads))
    gate_attrs = {k: v for k, v in {"num_heads": [(heads, 1)], "qkv_dim": [(heads, head_dim)]}.items() if _int(gate, k)}
    entries["forget_gate"] = [*gate_params, LocalAttributes(gate_attrs)]
    if _has_weight(getattr(module, "o_norm", None)):
        entries["o_norm"] = [ReplicatedWithGradAllReduce()]
    attrs = {"num_heads": [(heads, 1)], "qkv_dim": [(heads, head_dim)], "conv_dim": [(heads, 3 * head_dim)]}
    entries[""] = [LocalAttributes({k: v for k, v in attrs.items() if _int(module, k) is not None})]
    return entries, ""


def _short_conv(module: nn.Module, tp: int | None):
    """A gated short convolution: in_proj [B | C | x], a depthwise conv over x's channels, out_proj."""
    in_proj, out_proj, conv = _linear(module, "in_proj"), _linear(module, "out_proj"), _depthwise(module, "conv")
    if None in (in_proj, out_proj, conv):
        return None
    channels = conv.out_channels
    if in_proj.out_features != 3 * channels or out_proj.in_features != channels:
        return None
    return {
        "in_proj": [PackedColWiseParallel(3)],
        "conv": [DepthwiseConvParallel()],
        "out_proj": [RowWiseParallel()],
    }, ""


OUTPUT_NAMES = ("o_proj", "out_proj", "dense")


def _attention(module: nn.Module, tp: int | None):
    """Multi-head attention: q/k/v projections over whole heads of `head_dim`, an output projection."""
    head_dim = _int(module, "head_dim")
    q, k, v = (_linear(module, n) for n in ("q_proj", "k_proj", "v_proj"))
    out = next((n for n in OUTPUT_NAMES if _linear(module, n) is not None), None)
    if None in (head_dim, q, k, v, out) or head_dim <= 0:
        return None
    if q.out_features % head_dim or k.out_features % head_dim or v.out_features != k.out_features:
        return None
    heads, kv = q.out_features // head_dim, k.out_features // head_dim
    if getattr(module, out).in_features != q.out_features:
        return None
    entries: Entries = {
        "q_proj": [ColWiseParallel(units=heads)],
        "k_proj": [ColWiseParallel(units=kv)],
        "v_proj": [ColWiseParallel(units=kv)],
        out: [RowWiseParallel(units=heads)],
    }
    for name, child in module.named_children():
        weight = _param(child, "weight")
        if not isinstance(child, nn.Linear) and weight is not None and tuple(weight.shape) == (head_dim,):
            entries[name] = [ReplicatedWithGradAllReduce()]  # a per-head norm: sees only this rank's heads
    return entries, ""


def _latent_attention(module: nn.Module, tp: int | None):
    """Multi-head latent attention: q_proj or q_b_proj and kv_b_proj over whole heads, o_proj; the low-rank
    down-projections and their norms stay replicated, their gradients summed over tp (every head reads them)."""
    heads = _int(module, "num_heads")
    query = "q_proj" if _linear(module, "q_proj") is not None else "q_b_proj"
    q, kv_b, o = _linear(module, query), _linear(module, "kv_b_proj"), _linear(module, "o_proj")
    if None in (heads, q, kv_b, o) or q.out_features % heads or kv_b.out_features % heads:
        return None
    kv_a = _linear(module, "kv_a_proj_with_mqa")
    if kv_a is None:
        return None
    entries: Entries = {
        query: [ColWiseParallel(units=heads)],
        # the latent and the shared rotary key come out of one replicated projection: its output gradient is summed
        # over tp there, once for both paths, so kv_b_proj (which reads the latent) takes no entry of its own
        "kv_a_proj_with_mqa": [AllReduceOutputGradient()],
        "kv_b_proj": [EnteredColWiseParallel(units=heads)],
        "o_proj": [RowWiseParallel(units=heads)],
        "": [LocalAttributes({"num_heads": [(heads, 1)]})],
    }
    if _has_weight(getattr(module, "kv_a_layernorm", None)):
        entries["kv_a_layernorm"] = [ReplicatedWithGradAllReduce()]
    if query == "q_b_proj" and _linear(module, "q_a_proj") is not None:  # the query latent, as the kv latent
        entries.update({"q_a_proj": [AllReduceOutputGradient()], "q_b_proj": [EnteredColWiseParallel(units=heads)]})
        if _has_weight(getattr(module, "q_a_layernorm", None)):
            entries["q_a_layernorm"] = [ReplicatedWithGradAllReduce()]
    return entries, ""


def _grouped_output_attention(module: nn.Module, tp: int | None):
    """Attention with one shared kv head (`kv_proj`), a kv compressor, per-head `sinks` and a grouped low-rank output
    (`o_a_proj` over `config.o_groups` groups of heads, then `o_b_proj`): q_b_proj, the sinks and the output groups
    split by heads. What every rank's heads read whole -- the query latent (`q_a_proj`), the shared kv head
    (`kv_proj`) and the compressor's entries -- comes out of projections split by output features and gathered
    (`_gathered_projections`); their outputs' gradients are summed over tp where split heads read them."""
    heads, head_dim = _int(module, "num_heads"), _int(module, "head_dim")
    q_b, kv, o_a, o_b = (_linear(module, n) for n in ("q_b_proj", "kv_proj", "o_a_proj", "o_b_proj"))
    sinks, config = _param(module, "sinks"), getattr(module, "config", None)
    groups = _int(o_a, "n_groups") if o_a is not None else None
    if None in (heads, head_dim, q_b, kv, o_a, o_b, sinks, groups) or getattr(config, "o_groups", None) != groups:
        return None
    if kv.out_features != head_dim or q_b.out_features != heads * head_dim or heads % groups:
        return None
    kv_out = "kv_norm" if _has_weight(getattr(module, "kv_norm", None)) else "kv_proj"
    entries: Entries = {
        **_gathered_projections(module, ("q_a_proj", "kv_proj")),
        "q_b_proj": [ColWiseParallel(units=heads)],
        kv_out: [AllReduceOutputGradient()],
        "o_a_proj": [SplitParameter("weight", 0, groups), LocalAttributes({"n_groups": [(groups, 1)]})],
        "o_b_proj": [RowWiseParallel(units=groups)],
        "": [
            SplitParameter("sinks", 0, heads),
            LocalAttributes({"num_heads": [(heads, 1)], "num_key_value_groups": [(heads, 1)]}),
            LocalConfigAttributes({"o_groups": [(groups, 1)]}),
        ],
    }
    compressor = getattr(module, "compressor", None)
    if isinstance(compressor, nn.Module):
        entries["compressor"] = [AllReduceOutputGradient()]
        entries.update(_gathered_projections(compressor, ("kv_proj", "gate_proj"), "compressor."))
        indexer = getattr(compressor, "indexer", None)
        if isinstance(indexer, nn.Module):  # its top-k picks carry no gradient: the split is the weights' memory
            names = ("kv_proj", "gate_proj", "q_b_proj")
            entries.update(_gathered_projections(indexer, names, "compressor.indexer."))
    return entries, ""


def _gathered_projections(module: nn.Module, names: tuple[str, ...], prefix: str = "") -> Entries:
    """Column splits with gathered outputs for the projections `names` of `module` whose outputs the module reads
    whole: a compressor's kv / gate features (a softmax over each window per feature, then a norm over the whole head)
    and its indexer's, the query latent (normalized whole before q_b_proj), the shared kv head (normalized whole and
    read by every head). Each rank computes and holds 1/tp of the features; the all-gather makes them whole and its
    backward keeps this rank's part of the (whole) output gradient; the entry sums the input gradient over tp. The
    norms, the position biases and the indexer's per-head weights (`scorer.weights_proj`, one row a head) stay whole:
    they are a few hundred elements."""
    return {prefix + name: [ColWiseParallel(gather_output=True)] for name in names if _linear(module, name) is not None}


MLP_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
PACKED_MLP_NAMES = (("input_linear", "output_linear"),)  # gate|up packed in one projection


def _mlp(module: nn.Module, tp: int | None):
    """A gated MLP: two column-parallel input projections (or one packing gate|up), one row-parallel output."""
    for gate, up, down in MLP_NAMES:
        if all(_linear(module, n) is not None for n in (gate, up, down)):
            return {gate: [ColWiseParallel()], up: [ColWiseParallel()], down: [RowWiseParallel()]}, ""
    for packed, down in PACKED_MLP_NAMES:
        first, last = _linear(module, packed), _linear(module, down)
        if first is not None and last is not None and first.out_features == 2 * last.in_features:
            return {packed: [PackedColWiseParallel(2)], down: [RowWiseParallel()]}, ""
    return None


# Mixers first: their entries replace the tp plan's; the blocks after only fill what the tp plan leaves whole.
MIXERS: tuple[Recogniser, ...] = (_mamba2, _mamba1, _gated_delta_net, _delta_attention, _short_conv)
# blocks whose entries replace a tp plan's for their children: a translated plan leaves latent attention's replicated
# down-projections and norms without the gradient sum a sequence-parallel block (no column entry inside) needs
OWNED: tuple[Recogniser, ...] = (*MIXERS, _latent_attention)
BLOCKS: tuple[Recogniser, ...] = (_grouped_output_attention, _latent_attention, _attention, _mlp)


def _recognise(model: nn.Module, tp: int | None, recognisers) -> tuple[dict[str, Entries], dict[str, str]]:
    """{module name: its entries} for every module a recogniser takes, and {module name: why it stays whole}."""
    found, whole = {}, {}
    for name, module in model.named_modules():
        if any(name.startswith(done + ".") for done in found):
            continue
        for recognise in recognisers:
            result = recognise(module, tp)
            if result is None:
                continue
            entries, reason = result
            if entries is None:
                whole[name] = f"{type(module).__name__} stays whole: {reason}"
            else:
                found[name] = entries
            break
    return found, whole


def _absolute(found: Mapping[str, Entries]) -> dict[str, list[ParallelStyle]]:
    flat = {}
    for name, entries in found.items():
        for child, styles in entries.items():
            flat[f"{name}.{child}" if child else name] = styles
    return flat


def _as_regexes(flat: Mapping[str, list[ParallelStyle]], model: nn.Module) -> dict[str, object]:
    """Exact module names grouped into regexes with `\\d+` for layer indices where every member takes the same styles
    (same repr) and no other module of `model` matches (a mixer named `self_attn` in some layers, attention of that
    name in others); each entry is optional, since hybrid layers hold different blocks."""
    groups: dict[str, list[tuple[str, list[ParallelStyle]]]] = {}
    for name, styles in flat.items():
        pattern = r"\.".join(r"\d+" if part.isdigit() else re.escape(part) for part in name.split("."))
        groups.setdefault(pattern, []).append((name, styles))
    names = [n for n, _ in model.named_modules() if n]
    plan: dict[str, object] = {}
    for pattern, members in groups.items():
        matched = sum(1 for n in names if re.fullmatch(pattern, n))
        if len({repr(styles) for _, styles in members}) == 1 and matched == len(members):
            plan[pattern] = optional(members[0][1])
        else:
            for name, styles in members:
                plan[re.escape(name)] = optional(styles)
    return plan


def mixer_plan(model: nn.Module, prefix: str = "", tp: int | None = None) -> dict[str, object]:
    """regex -> styles for every mixer under the (regex) `prefix` and every attention / MLP block, derived from
    their structure; `tp` decides whether a gated norm over groups can be split (None: assume it can)."""
    del prefix  # module names are absolute: the base-model prefix is part of them
    found, _ = _recognise(model, tp, MIXERS)
    blocks, _ = _recognise(model, tp, BLOCKS)
    found.update({name: entries for name, entries in blocks.items() if not _inside(name, found)})
    return _as_regexes(_absolute(found), model)


def _inside(name: str, found: Mapping[str, object]) -> bool:
    return any(name == other or name.startswith(other + ".") for other in found)


def _covered(plan: Mapping[str, object], names) -> set[str]:
    patterns = [re.compile(key) for key in plan]
    return {name for name in names if any(p.fullmatch(name) for p in patterns)}


def merge_mixer_plan(
    plan: Mapping[str, object], model: nn.Module, tp: int | None = None, blocks: bool = True
) -> dict[str, object]:
    """`plan` (translated from the tp plan) with the mixers' entries in place of its own for their children, and
    (`blocks`) attention / MLP blocks the plan leaves whole (none of their projections named) split Megatron's way."""
    mixers, _ = _recognise(model, tp, OWNED)
    mixer_names = set(_absolute(mixers))
    names = [n for n, _ in model.named_modules() if n]
    kept = {
        key: style
        for key, style in plan.items()
        if not any(re.fullmatch(key, n) for n in mixer_names)
        and not any(re.fullmatch(key, n) for n in names if _inside(n, mixers) and n not in mixers)
    }
    covered = _covered(kept, names)
    found = _recognise(model, tp, BLOCKS)[0] if blocks else {}
    fill = {}
    for name, entries in found.items():
        if _inside(name, mixers):
            continue
        absolute = _absolute({name: entries})
        if not any(n in covered for n in absolute):
            fill[name] = entries
        else:
            norms = _forgotten_head_norms(model.get_submodule(name), name, covered, tp)
            if norms:
                fill[name] = norms
    return {**kept, **_as_regexes(_absolute({**mixers, **fill}), model)}


def _forgotten_head_norms(module: nn.Module, name: str, covered: set[str], tp: int | None) -> Entries:
    """The per-head norms of an attention block whose heads the tp plan splits but whose norms it does not name
    (Qwen3-VL-MoE's q_norm / k_norm): each sees only this rank's heads, so its gradient is summed over tp. Only
    plain attention's: a latent attention's kv_a_layernorm reads the whole latent and is left to the plan."""
    found = _attention(module, tp)
    if found is None:
        return {}
    return {
        child: styles
        for child, styles in found[0].items()
        if f"{name}.{child}" not in covered and all(isinstance(s, ReplicatedWithGradAllReduce) for s in styles)
    }


def check_mixers(model: nn.Module, tp: int) -> None:
    """Raise, before anything moves, when `tp` cannot split a mixer's heads: one error naming the module, the
    attribute and the tp sizes that would."""
    mixers, _ = _recognise(model, tp, MIXERS)
    for name, module in dict(model.named_modules()).items():
        if name not in mixers:
            continue
        counts = {a: _int(module, a) for a in ("num_heads", "num_v_heads", "num_k_heads", "n_groups")}
        counts["intermediate_size"] = _int(module, "intermediate_size") if _mamba1(module, tp) else None
        for attr, count in counts.items():
            if count is None:
                continue
            replicable = attr in ("num_k_heads", "n_groups") and count < tp and tp % count == 0
            replicable = replicable and not (attr == "num_k_heads" and hasattr(module, "in_proj_qkvz"))
            if count % tp and not replicable:
                allowed = [d for d in range(1, count + 1) if count % d == 0]
                raise ValueError(
                    f"{name} ({type(module).__name__}): {attr}={count} cannot be split over tensor_parallel_size={tp}; "
                    f"allowed tp sizes: {allowed}"
                )


def replicated_by_layer(model: nn.Module, plan: Mapping[str, object]) -> dict[str, list[str]]:
    """{layer: names of the parameters `plan` keeps whole there} (layers are the module names up to the first layer
    index; names are relative to the layer), from the styles' rank-free split specs."""
    from ..plan.apply import resolve_plan

    split: set[str] = set()
    modules = dict(model.named_modules())
    for name, styles in resolve_plan(model, plan).items():
        for style in styles:
            for leaf, spec in style.param_specs(modules[name]).items():
                if spec.is_split:
                    split.add(f"{name}.{leaf}" if name else leaf)
    whole: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        if name in split:
            continue
        match = re.match(r"(.*?\.\d+)\.(.*)", name)
        layer, rest = (match.group(1), match.group(2)) if match else ("", name)
        whole.setdefault(layer, []).append(rest)
    return whole


def mixers_left_whole(model: nn.Module, tp: int) -> dict[str, str]:
    """{module name: why it stays whole} for the mixers whose structure tp cannot split (e.g. a gated norm over
    fewer groups than ranks)."""
    return _recognise(model, tp, MIXERS)[1]
