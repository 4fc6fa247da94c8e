"""Make a Hugging Face decoder context-parallel: its forward sees this rank's chunks of the sequence.

A forward pre-hook on the model cuts the batch: labels are shifted first (so the last token of a chunk keeps
the first token of the next as its target), the sequence is padded with masked, ignored tokens up to a multiple
of 2 cp, then every rank keeps its two chunks of input_ids / inputs_embeds, position_ids (global positions, so
rotary embeddings follow the split) and labels. The padding mask of the whole sequence goes to the layers as
the marker the attention function reads. A forward hook adds the router aux loss of a MoE model over the whole
rows (router_loss.py) and gathers the logits over cp when no gradient is being taken (evaluation, metrics); a
training forward keeps this rank's chunks (the loss is already complete). A sequence classifier's head pools each
row's last real token over cp instead, its logits whole on every rank, its per-row labels left whole (classifier.py).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
from torch import nn

from ..mesh import ranks
from ..packing import PACKING_KEYS, carrier, is_carrier, packed_inputs, segment_ids
from ..state import find_state, parallel_state, refuse
from .attention import (
    ATTENTION_KEY,
    ContextParallelAttention,
    check_strategy,
    is_marker,
    marked_blocks,
    register_attention,
    sequence_mask,
)
from .classifier import PooledScores, classifier_head
from .load_balance import ChunkLayout, SequenceCut, pad_sequence
from .loss import ContextParallelLoss
from .packed import Documents, chunk_count, documents_for
from .router_loss import RouterLoss, add_router_loss, install_router_loss, wants_router_logits
from .ulysses import check_heads_divide

IGNORE_INDEX = -100


def check_context_parallel(
    model: nn.Module,
    cp: int,
    strategy: str,
    tp: int = 1,
    key: str = "context_parallel_strategy",
    *,
    supported: bool,
    why: str | None = None,
) -> None:
    """Whether `model` can be made context-parallel over `cp` ranks with `strategy` (its q/k/v split over `tp`
    ranks first); raises before anything changes, naming `key` (the caller's name for the strategy). `supported`:
    the model's capabilities allow context parallelism; `why`: the module and layer that block it, where known."""
    check_strategy(strategy, key)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not supported or not (hasattr(model, "lm_head") or classifier_head(model) is not None):
        reason = why or "its family does not declare context parallelism"
        raise NotImplementedError(
            f"context parallelism (cp={cp}) is not supported for {type(model).__name__} (model_type {model_type!r}): "
            f"{reason}; allowed for this model: cp=1"
        )
    if not any(hasattr(m, "num_key_value_groups") for m in model.modules()):
        raise NotImplementedError(f"no attention module found in {type(model).__name__} for context parallelism")
    if strategy == "all_to_all":
        config = getattr(config, "text_config", None) or config  # an image-text model: its language model's heads
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        # per tp rank: whole heads; fewer kv heads than tp ranks are replicated, one per rank
        check_heads_divide(heads // tp, max(kv_heads // tp, 1), cp, key)


def apply_context_parallel(model: nn.Module, group, strategy: str = "ring") -> None:
    """Route `model`'s attention through ring (or all-to-all) attention over `group` and split its inputs (once:
    a model parallelized by the Parallelizer, then given data parallelism by `parallelize`, comes here twice)."""
    if parallel_state(model).context_parallel is not None:
        return
    decoder = composite_decoder(model)
    scope = decoder if decoder is not None else model  # a vision tower's attention runs on whole images
    attention = [m for m in scope.modules() if hasattr(m, "num_key_value_groups")]
    cp, rank = ranks.world_size(group), ranks.rank(group)
    settings = ContextParallelAttention(group, rank, cp, strategy)
    for module in attention:
        parallel_state(module).context_parallel = settings
    register_attention()
    scope.config._attn_implementation = ATTENTION_KEY
    head = classifier_head(model)
    pooled = None if head is None else PooledScores(model, group)  # a sequence classifier: see classifier.py
    if pooled is None:
        model.loss_function = ContextParallelLoss(model.loss_function, group)
    else:
        head.register_forward_hook(pooled)
    parallel_state(model).context_parallel = settings
    router_loss = install_router_loss(model, group)
    if decoder is None:
        split = functools.partial(_split_inputs, router_loss=router_loss, pooled=pooled)
        model.register_forward_pre_hook(split, with_kwargs=True)
    else:  # the labels at the model's entry, the embeddings (image features merged in) at the language model's
        model.register_forward_pre_hook(_split_labels, with_kwargs=True)
        decoder.register_forward_pre_hook(functools.partial(_split_decoder_inputs, owner=model), with_kwargs=True)
    model.register_forward_hook(functools.partial(_after_forward, router_loss=router_loss, whole=pooled is not None))
    refuse(model, "generate", NotImplementedError, NO_GENERATE)


def mark_gradients_reduced(model: nn.Module) -> None:
    """Data parallelism over dp x cp now sums the cp ranks' partial gradients (called by the engine)."""
    for module in model.modules():
        state = find_state(module)
        if state is not None and state.context_parallel is not None:
            state.gradients_reduced = True


def check_gradients_reduced(model: nn.Module) -> None:
    """A cp rank's gradients cover its own tokens only: training without the dp x cp reduction would be wrong."""
    if torch.is_grad_enabled() and not parallel_state(model).gradients_reduced:
        raise RuntimeError(
            "a context-parallel model (cp > 1) trains only with its gradients reduced over dp x cp: after "
            "Parallelizer.parallelize, call op.parallelize(model, optimizer, mesh, {'dp_config': {'sharding_level': "
            "0}}) (any level 0-3), or train with ParallelTrainer; for evaluation run under torch.no_grad()"
        )


def split_batch(
    settings: ContextParallelAttention, kwargs: dict, blocks: torch.Tensor | None = None
) -> tuple[dict, SequenceCut]:
    """This rank's part of a whole batch (input_ids or inputs_embeds, attention_mask, position_ids, labels; a packed
    batch's document boundaries) and how the sequence was cut (its length before padding, the layout). `blocks`: the
    image block of every token of the whole sequence ((batch, seq), -1 outside any: `image_blocks`), carried to the
    attention by the marker."""
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if tokens is None:
        raise ValueError("a context-parallel model needs input_ids or inputs_embeds")
    if kwargs.get("output_attentions"):
        raise NotImplementedError("output_attentions is not supported under context parallelism (no weights are kept)")
    keep = kwargs.get("logits_to_keep")
    if keep is not None and not (isinstance(keep, int) and keep == 0):
        raise NotImplementedError(
            f"logits_to_keep={keep if isinstance(keep, int) else 'a tensor'} is not supported under context "
            "parallelism (each rank holds chunks of the sequence, not its last positions); allowed: 0, every position"
        )
    packed = packed_inputs(kwargs)
    if packed is not None:  # several documents in a row: cut by attention work, attend within documents
        if blocks is not None:
            raise NotImplementedError(
                "packed rows with image tokens that attend both ways (token_type_ids) are not supported under context "
                "parallelism; pass one sequence per row"
            )
        return _split_packed(settings, packed, tokens)
    batch, length = tokens.shape[:2]
    layout = ChunkLayout.for_sequence(length, settings.cp, settings.layout_rank)
    mask = kwargs.get("attention_mask")
    if mask is None:
        mask = torch.ones(batch, length, dtype=torch.bool, device=tokens.device)
    elif mask.dim() != 2:
        raise ValueError("under context parallelism the attention_mask must be 2-D (batch, seq) padding or None")
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = torch.arange(length, device=tokens.device).expand(batch, length)
    elif length > 1 and not bool((positions.diff(dim=-1) == 1).all()):
        raise NotImplementedError(
            "position_ids that do not count up by one in a row with an attention mask are not supported under "
            "context parallelism; pass packed rows without attention_mask (each padding token its own segment) or "
            "one sequence per row"
        )
    padded = layout.length
    extra_positions = positions[:, -1:] + torch.arange(1, padded - length + 1, device=tokens.device)
    out = dict(kwargs)
    for name in ("input_ids", "inputs_embeds"):
        if kwargs.get(name) is not None:
            out[name] = layout.take(pad_sequence(kwargs[name], padded, 0))
    out["position_ids"] = layout.take(torch.cat([positions, extra_positions], dim=1))
    blocks = None if blocks is None else pad_sequence(blocks.to(tokens.device), padded, -1)
    out["attention_mask"] = sequence_mask(pad_sequence(mask.bool(), padded, False), blocks=blocks)
    labels = kwargs.get("labels")
    if labels is not None:
        shifted = pad_sequence(labels[:, 1:], padded, IGNORE_INDEX)
        out["labels"] = layout.take(shifted)
    out["use_cache"] = False
    return out, SequenceCut(length, layout)


def packed_documents(settings: ContextParallelAttention, positions: torch.Tensor, real: torch.Tensor) -> Documents:
    """The documents and layout of a packed batch whose whole padded rows have `positions` (segment-encoded) and
    `real` (False: padding the split added)."""
    return documents_for(segment_ids(positions), settings.cp, settings.layout_rank, real=real, positions=positions)


def _split_packed(settings: ContextParallelAttention, kwargs: dict, tokens: torch.Tensor) -> tuple[dict, SequenceCut]:
    batch, length = tokens.shape[:2]
    _, padded = chunk_count(length, settings.cp)
    positions = pad_sequence(kwargs["position_ids"], padded, 0)  # 0: the padding never continues a document
    real = pad_sequence(torch.ones(batch, length, dtype=torch.bool, device=tokens.device), padded, False)
    documents = packed_documents(settings, positions, real)
    layout = documents.layout
    out = {k: v for k, v in kwargs.items() if k not in PACKING_KEYS}
    for name in ("input_ids", "inputs_embeds"):
        if kwargs.get(name) is not None:
            out[name] = layout.take(pad_sequence(kwargs[name], padded, 0))
    out["position_ids"] = layout.take(positions)
    out["attention_mask"] = sequence_mask(real, documents)
    labels = kwargs.get("labels")
    if labels is not None:
        out["labels"] = layout.take(pad_sequence(labels[:, 1:], padded, IGNORE_INDEX))
    out["use_cache"] = False
    return out, SequenceCut(length, layout)


@functools.cache
def _forward_signature(model_class: type) -> inspect.Signature:
    return inspect.signature(model_class.forward)


def _split_inputs(model: nn.Module, args: tuple, kwargs: dict, router_loss: RouterLoss, pooled: PooledScores | None):
    if kwargs.get("past_key_values") is not None:
        raise NotImplementedError("key/value caches are not supported under context parallelism")
    bound = _forward_signature(type(model)).bind_partial(model, *args, **kwargs).arguments
    bound.pop("self", None)
    extra = bound.pop("kwargs", {})
    check_gradients_reduced(model)
    state = parallel_state(model)
    settings = state.context_parallel
    whole = {**bound, **extra}
    labels = whole.pop("labels", None) if pooled is not None else None  # a classifier's: one per row, kept whole
    split, cut = split_batch(settings, whole)
    if pooled is not None:
        pooled.record(whole, cut.layout)
        split["labels"] = labels
    state.sequence_length, state.sequence_layout = cut.length, cut.layout
    requested = extra.get("output_router_logits", bound.get("output_router_logits"))
    if wants_router_logits(model, router_loss, requested):
        split["output_router_logits"] = False  # the aux loss is added after the forward, over the whole rows
        router_loss.mask = cut.layout.take(split["attention_mask"][:, 0, 0, :]).reshape(-1)
        router_loss.labels = split.get("labels") is not None
    return (), split


def composite_decoder(model: nn.Module) -> nn.Module | None:
    """The language model of a composite image-text model (its config has a `vision_config`), None for a decoder.
    Such a model merges its image features into the whole sequence's embeddings before its language model runs: the
    sequence is cut at the language model's entry (`_split_decoder_inputs`), the labels at the model's
    (`_split_labels`)."""
    if getattr(getattr(model, "config", None), "vision_config", None) is None:
        return None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    return decoder if isinstance(decoder, nn.Module) and decoder is not model else None


def _bound_arguments(module: nn.Module, args: tuple, kwargs: dict) -> dict:
    bound = _forward_signature(type(module)).bind_partial(module, *args, **kwargs).arguments
    bound.pop("self", None)
    return {**bound, **bound.pop("kwargs", {})}


def image_blocks(token_type_ids: torch.Tensor) -> torch.Tensor:
    """(batch, seq): each image's tokens (a run of token type 1) numbered from 0 along its row, -1 elsewhere: the
    tokens Gemma 3 lets see each other both ways (as transformers' gemma3 `get_block_sequence_ids_for_mask`)."""
    image = token_type_ids == 1
    starts = image.clone()
    starts[:, 1:] &= ~image[:, :-1]
    return torch.where(image, starts.long().cumsum(-1) - 1, -1)


def _split_labels(model: nn.Module, args: tuple, kwargs: dict):
    """A composite image-text model's entry: the whole inputs go on (the images are merged into the whole
    sequence), the labels are shifted and cut as the language model's entry will cut the sequence. A model whose
    image tokens attend both ways (its forward takes `token_type_ids`: Gemma 3, the only kind the family check lets
    through) builds its layers' masks before its language model runs: it gets the marker of the whole sequence (its
    padding mask and image blocks) instead of its padding mask, which transformers' mask functions hand on untouched,
    and the language model's entry cuts it (`_split_decoder_inputs`)."""
    if kwargs.get("past_key_values") is not None:
        raise NotImplementedError("key/value caches are not supported under context parallelism")
    inputs = _bound_arguments(model, args, kwargs)
    if packed_inputs(inputs) is not None:
        raise NotImplementedError(
            f"packed rows are not supported under context parallelism for {type(model).__name__} (its image "
            "features are merged before the sequence is cut); pass one sequence per row"
        )
    check_gradients_reduced(model)
    state = parallel_state(model)
    settings = state.context_parallel
    tokens = inputs.get("input_ids")
    tokens = inputs.get("inputs_embeds") if tokens is None else tokens
    if tokens is None:
        raise ValueError("a context-parallel model needs input_ids or inputs_embeds")
    layout = ChunkLayout.for_sequence(tokens.shape[1], settings.cp, settings.layout_rank)
    labels = inputs.get("labels")
    if labels is not None:
        inputs["labels"] = layout.take(pad_sequence(labels[:, 1:], layout.length, IGNORE_INDEX))
    inputs["use_cache"] = False
    if "token_type_ids" in _forward_signature(type(model)).parameters:
        mask = inputs.get("attention_mask")
        if mask is None:
            mask = torch.ones(tokens.shape[:2], dtype=torch.bool, device=tokens.device)
        elif mask.dim() != 2:
            raise ValueError("under context parallelism the attention_mask must be 2-D (batch, seq) padding or None")
        types = inputs.get("token_type_ids")
        inputs["attention_mask"] = sequence_mask(mask, blocks=None if types is None else image_blocks(types))
    state.sequence_length, state.sequence_layout = tokens.shape[1], layout
    return (), inputs


def _whole_marker(decoder: nn.Module, inputs: dict) -> torch.Tensor | None:
    """The marker of the whole sequence the model's entry made (`_split_labels`), as the language model receives it:
    itself, or the masks per layer type that its model built from it (every one the marker, handed on untouched)."""
    mask = inputs.get("attention_mask")
    masks = list(mask.values()) if isinstance(mask, dict) else [mask]
    if not any(is_marker(m) for m in masks):
        if isinstance(mask, dict):
            raise NotImplementedError(
                f"{type(decoder).__name__} got its layers' attention masks built before it ran, not from the "
                "context-parallel marker; context parallelism builds every layer's mask from global positions"
            )
        return None
    if not all(m is masks[0] for m in masks):
        raise NotImplementedError(
            f"{type(decoder).__name__} got attention masks built over the whole sequence besides the context-parallel "
            "marker; context parallelism builds every layer's mask from global positions"
        )
    return masks[0]


def _split_decoder_inputs(decoder: nn.Module, args: tuple, kwargs: dict, owner: nn.Module):
    """The language model's entry: this rank's chunks of the merged embeddings and of the position ids (M-RoPE's
    (3 or 4, batch, seq) ones cut along the sequence like the others), the whole padding mask as the marker (with the
    image blocks, where the model's entry found them)."""
    inputs = _bound_arguments(decoder, args, kwargs)
    whole = _whole_marker(decoder, inputs)
    blocks = None
    if whole is not None:
        inputs["attention_mask"], blocks = whole[:, 0, 0, :], marked_blocks(whole)
    positions = inputs.get("position_ids")
    multi = positions is not None and positions.dim() == 3
    if multi:
        inputs.pop("position_ids")
    split, cut = split_batch(parallel_state(owner).context_parallel, inputs, blocks)
    if multi:
        padded, length = cut.layout.length, cut.length
        more = positions[..., -1:] + torch.arange(1, padded - length + 1, device=positions.device)
        whole = torch.cat([positions, more], dim=-1)
        split["position_ids"] = torch.stack([cut.layout.take(rows) for rows in whole])
    return (), split


def _after_forward(model: nn.Module, args: tuple, output, router_loss: RouterLoss, whole: bool):
    if router_loss.mask is not None:
        output = add_router_loss(model, router_loss, output)
    logits = getattr(output, "logits", None)
    if logits is None or torch.is_grad_enabled() or whole:  # whole: a classifier's pooled logits
        return output
    state = parallel_state(model)
    output.logits = state.sequence_layout.gather(logits, state.context_parallel.group)[:, : state.sequence_length]
    return output


NO_GENERATE = (
    "generate() is not supported on a context-parallel model (cp > 1): decoding needs a key/value cache, which "
    "ring attention does not keep. Generate with the model parallelized without cp (e.g. op.init_mesh(tp=N)); "
    "checkpoints do not depend on cp"
)


def pipeline_functions(model: nn.Module) -> tuple[Callable, Callable, Callable]:
    """For a pipeline over a context-parallel `model`: (split, gather_logits, stage_inputs) -- this rank's chunks of
    a whole batch (input_ids and the shifted labels; the padding mask of the whole padded sequence, or a packed batch's
    carrier, travels with the activations), the whole sequence's logits back from the cp ranks' chunks, and the
    layers' mask and positions (they follow the split) from what travels. A packed batch is cut micro-batch by
    micro-batch (each stage sees one micro-batch's rows, and finds the same layout from its carrier)."""
    settings = parallel_state(model).context_parallel

    def split(input_ids, labels, attention_mask, microbatches: int = 1):
        check_gradients_reduced(model)
        if is_carrier(attention_mask):
            return _split_packed_rows(input_ids, labels, attention_mask, microbatches)
        parts, cut = split_batch(settings, {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask})
        return parts["input_ids"], parts.get("labels"), parts["attention_mask"][:, 0, 0, :].long(), cut

    def _split_packed_rows(input_ids, labels, travelling, microbatches):
        length = input_ids.shape[1]
        _, padded = chunk_count(length, settings.cp)
        real = pad_sequence(travelling[:, 0], padded, 0)
        positions = pad_sequence(travelling[:, 1], padded, 0)
        shifted = None if labels is None else pad_sequence(labels[:, 1:], padded, IGNORE_INDEX)
        parts: list[tuple] = []
        cuts: list[tuple[int, SequenceCut]] = []
        for rows in torch.arange(input_ids.shape[0]).chunk(microbatches):
            rows = rows.to(input_ids.device)
            layout = packed_documents(settings, positions[rows], real[rows].bool()).layout
            parts.append(
                (
                    layout.take(pad_sequence(input_ids[rows], padded, 0)),
                    None if shifted is None else layout.take(shifted[rows]),
                )
            )
            cuts.append((len(rows), SequenceCut(length, layout)))
        ids = torch.cat([p[0] for p in parts])
        cut_labels = None if labels is None else torch.cat([p[1] for p in parts])
        return ids, cut_labels, carrier(positions, real), cuts

    def gather_logits(logits: torch.Tensor, cut) -> torch.Tensor:
        if isinstance(cut, SequenceCut):
            return cut.layout.gather(logits, settings.group)[:, : cut.length]
        pieces, start = [], 0
        for rows, part in cut:
            pieces.append(part.layout.gather(logits[start : start + rows], settings.group)[:, : part.length])
            start += rows
        return torch.cat(pieces)

    def stage_inputs(travelling: torch.Tensor) -> dict:
        if is_carrier(travelling):
            real = travelling[:, 0].bool()
            documents = packed_documents(settings, travelling[:, 1], real)
            positions = documents.layout.take(travelling[:, 1])
            return {"attention_mask": sequence_mask(real, documents), "position_ids": positions}
        layout = ChunkLayout(settings.cp, settings.layout_rank, travelling.shape[1])
        positions = layout.positions(travelling.device).expand(travelling.shape[0], -1)
        return {"attention_mask": sequence_mask(travelling), "position_ids": positions}

    return split, gather_logits, stage_inputs
