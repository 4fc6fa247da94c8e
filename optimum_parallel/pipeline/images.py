"""A batch's images (and videos) dealt to its rows, so that a pipeline's first stage runs each micro-batch's own.

A vision-language batch gives its images along their own first dim, not the rows': `pixel_values` (one entry per
image, or, with a grid, one per patch) and per-image metadata (`image_grid_thw`). The model puts each image's
features at its placeholder tokens in row order, so the images of a row are the next ones in order whose tokens that
row holds: an image with a grid gives prod(grid) / merge**2 tokens (merge: the vision config's
`spatial_merge_size`) from prod(grid) patches, one without a grid the same share of the image tokens as every other.

A micro-batch without images of a kind gets `pixel_values` None and empty metadata (the Qwen models then still compute
its M-RoPE positions, as one device does for a row without an image)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# (pixels key, per-item metadata keys, config attributes naming the placeholder token), per kind of visual input
KINDS = (
    ("pixel_values", ("image_grid_thw",), ("image_token_id", "image_token_index")),
    ("pixel_values_videos", ("video_grid_thw", "second_per_grid_ts"), ("video_token_id", "video_token_index")),
)
IMAGE_KEYS = tuple(key for pixels, metadata, _ in KINDS for key in (pixels, *metadata))


@dataclass(frozen=True)
class DealtKind:
    """One kind's inputs of the whole batch and, per row, the range of its items and of its pixel entries."""

    pixels: str
    tensors: dict[str, torch.Tensor]
    items: list[tuple[int, int]]
    entries: list[tuple[int, int]]

    def for_rows(self, first: int, last: int) -> dict[str, torch.Tensor | None]:
        """The inputs of rows first..last (inclusive): pixels None when they hold none of this kind."""
        (start, _), (_, stop) = self.entries[first], self.entries[last]
        (begin, _), (_, end) = self.items[first], self.items[last]
        out: dict[str, torch.Tensor | None] = {}
        for key, tensor in self.tensors.items():
            if key == self.pixels:
                out[key] = tensor[start:stop] if stop > start else None
            else:
                out[key] = tensor[begin:end]
        return out


@dataclass(frozen=True)
class DealtImages:
    """The batch's visual inputs, each kind dealt to the rows (`for_rows`: what rows first..last take)."""

    kinds: tuple[DealtKind, ...]

    def for_rows(self, rows: torch.Tensor) -> dict[str, torch.Tensor | None]:
        first, last = int(rows[0]), int(rows[-1])
        return {key: value for kind in self.kinds for key, value in kind.for_rows(first, last).items()}


def _token_id(config, attributes: tuple[str, ...], key: str) -> int:
    for attribute in attributes:
        value = getattr(config, attribute, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"{key} given, but {type(config).__name__} names no placeholder token ({' or '.join(attributes)})")


def _bounds(counts: list[int]) -> list[int]:
    bounds = [0]
    for count in counts:
        bounds.append(bounds[-1] + count)
    return bounds


def deal_images(config, input_ids: torch.Tensor, inputs: dict[str, torch.Tensor]) -> DealtImages | None:
    """`inputs`' visual tensors (keys of `IMAGE_KEYS`) dealt to the rows of `input_ids`; None without any. Raises
    ValueError, the same on every rank, when the placeholder tokens do not match the images."""
    kinds = []
    for pixels, metadata, attributes in KINDS:
        tensors = {key: inputs[key] for key in (pixels, *metadata) if inputs.get(key) is not None}
        if pixels not in tensors:
            if tensors:
                raise ValueError(f"{', '.join(tensors)} given without {pixels}")
            continue
        per_row = (input_ids == _token_id(config, attributes, pixels)).sum(-1).tolist()
        grid = tensors.get(metadata[0])
        if grid is not None:
            merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", 1)
            entries = grid.prod(-1).tolist()
            tokens = [patches // merge**2 for patches in entries]
        else:
            items = tensors[pixels].shape[0]
            share, left = divmod(sum(per_row), max(items, 1))
            if left or not items:
                raise ValueError(
                    f"image tokens and images do not match: {sum(per_row)} placeholder tokens for {items} images of "
                    f"{pixels}"
                )
            tokens, entries = [share] * items, [1] * items
        kinds.append(DealtKind(pixels, tensors, *_deal(per_row, tokens, entries, pixels)))
    return DealtImages(tuple(kinds)) if kinds else None


def _deal(per_row: list[int], tokens: list[int], entries: list[int], pixels: str):
    """Per row, the range of its items and of their pixel entries: items in order, each wholly inside one row."""
    if sum(tokens) != sum(per_row):
        raise ValueError(
            f"image tokens and images do not match: {sum(per_row)} placeholder tokens, {sum(tokens)} image features "
            f"from {pixels}"
        )
    counts, item = [], 0
    for row_tokens in per_row:
        taken = 0
        start = item
        while taken < row_tokens:
            taken += tokens[item]
            item += 1
        if taken != row_tokens:
            raise ValueError(
                f"image tokens and images do not match: an image of {pixels} has {tokens[item - 1]} features, which "
                "its row's placeholder tokens do not hold whole"
            )
        counts.append(item - start)
    items, pixels_at = _bounds(counts), _bounds(entries)
    spans = list(zip(items, items[1:], strict=False))
    return spans, [(pixels_at[a], pixels_at[b]) for a, b in spans]
