"""Tiny vision-language models and their image batches (llava, gemma3, qwen2_5_vl, qwen3_vl), built from transformers'
own config classes: shared by tests/families/test_vlm.py and the family matrix (tests/family_matrix.py)."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForImageTextToText,
    Gemma3Config,
    LlavaConfig,
    Qwen2_5_VLConfig,
    Qwen3_5Config,
    Qwen3_5MoeConfig,
    Qwen3VLConfig,
    Qwen3VLMoeConfig,
)

TOL = 1e-5
VOCAB = 132  # 128 text tokens, then the image / video / vision start / vision end (boi / eoi) tokens
IMAGE, VIDEO, START, END = 128, 129, 130, 131
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
VISION = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2)
QWEN_VISION = dict(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4, temporal_patch_size=2, out_hidden_size=64
)
MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}


def _llava() -> LlavaConfig:
    return LlavaConfig(
        vision_config=dict(VISION, model_type="clip_vision_model", image_size=16, patch_size=4, projection_dim=32),
        text_config=dict(TEXT, model_type="llama"),
        image_token_index=IMAGE,
        vision_feature_layer=-1,  # every vision layer feeds the image features (none left without a gradient)
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )


def _gemma3() -> Gemma3Config:
    return Gemma3Config(
        vision_config=dict(
            VISION, model_type="siglip_vision_model", image_size=16, patch_size=4, vision_use_head=False
        ),
        text_config=dict(TEXT, head_dim=16, sliding_window=8),
        image_token_index=IMAGE,
        boi_token_index=START,
        eoi_token_index=END,
        mm_tokens_per_image=4,  # 4 x 4 patches average-pooled to 2 x 2
        tie_word_embeddings=False,  # as the matrix's text models (a tied one: tests/families/test_vlm_pipeline.py)
    )


def _qwen2_5_vl() -> Qwen2_5_VLConfig:
    return Qwen2_5_VLConfig(
        vision_config=dict(QWEN_VISION, spatial_merge_size=2, window_size=16, fullatt_block_indexes=[1]),
        text_config=dict(TEXT, rope_parameters=dict(MROPE)),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )


def _qwen3_vl() -> Qwen3VLConfig:
    return Qwen3VLConfig(
        vision_config=dict(QWEN_VISION, spatial_merge_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0]),
        text_config=dict(TEXT, head_dim=16, rope_parameters=dict(MROPE, mrope_interleaved=True)),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
        tie_word_embeddings=False,
    )


def _qwen3_5() -> Qwen3_5Config:
    """Qwen3.5's vision-language model: its language model a gated delta net layer, then an attention layer."""
    delta_net = dict(
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    )
    return Qwen3_5Config(
        vision_config=dict(QWEN_VISION, spatial_merge_size=2, num_position_embeddings=16),
        text_config=dict(TEXT, head_dim=16, rope_parameters=dict(MROPE, mrope_interleaved=True), **delta_net),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
        tie_word_embeddings=False,
    )


def _qwen3_vl_moe() -> Qwen3VLMoeConfig:
    """Qwen3-VL's MoE model: every language-model layer a sparse block of 4 experts, 2 per token (no shared expert)."""
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    return Qwen3VLMoeConfig(
        vision_config=dict(QWEN_VISION, spatial_merge_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0]),
        text_config=dict(TEXT, head_dim=16, rope_parameters=dict(MROPE, mrope_interleaved=True), **experts),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
        tie_word_embeddings=False,
    )


def _qwen3_5_moe() -> Qwen3_5MoeConfig:
    """Qwen3.5's MoE vision-language model: an attention layer, then a gated delta net layer, each with a sparse block
    of 4 experts (2 per token) beside a shared expert. In this order the delta net's A_log gradient is near fp32's 1e-5
    floor; reading the image tokens straight from the embedding, its floor was 1-6e-4 from one 1e-7 nudge to another
    (tp2+sp equal within 1e-9 in float64)."""
    text = dict(
        TEXT,
        head_dim=16,
        rope_parameters=dict(MROPE, mrope_interleaved=True),
        layer_types=["full_attention", "linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    )
    return Qwen3_5MoeConfig(
        vision_config=dict(QWEN_VISION, spatial_merge_size=2, num_position_embeddings=16),
        text_config=text,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
        tie_word_embeddings=False,
    )


# model type -> its tiny config (vision tower 2 layers of width 32, 16 x 16 images; language model hidden 64, 2 layers)
TINY_VLM_CONFIGS = {
    "llava": _llava,
    "gemma3": _gemma3,
    "qwen2_5_vl": _qwen2_5_vl,
    "qwen3_vl": _qwen3_vl,
    "qwen3_5": _qwen3_5,
    "qwen3_vl_moe": _qwen3_vl_moe,
    "qwen3_5_moe": _qwen3_5_moe,
}
QWEN_GRIDS = [(1, 4, 4), (1, 4, 8)]  # (t, h, w) patches of each row's image: 4 and 8 image tokens after the merge


def _image_block(config, row: int) -> tuple[list[int], torch.Size | tuple]:
    """The tokens a processor puts for one image (and the grid it was cut into, for the Qwen models)."""
    model_type = config.model_type
    if model_type == "llava":
        vision = config.vision_config
        return [IMAGE] * (vision.image_size // vision.patch_size) ** 2, ()
    if model_type == "gemma3":
        return [START] + [IMAGE] * config.mm_tokens_per_image + [END], ()
    t, h, w = QWEN_GRIDS[row % len(QWEN_GRIDS)]
    merge = config.vision_config.spatial_merge_size
    return [START] + [IMAGE] * (t * h * w // merge**2) + [END], (t, h, w)


def make_vlm_inputs(config, batch: int = 2, seq: int = 32, seed: int = 1, image_tokens_delta: int = 0) -> dict:
    """One image per row (pixel_values as the model's processor gives them), its tokens placed after a few text
    tokens; row 0 left-padded by 3; labels -100 at padding, image tokens and mid-sequence. `image_tokens_delta` drops
    (or adds) image tokens in row 0, for the bad-input check."""
    gen = torch.Generator().manual_seed(seed)
    rows, types, images, grids = [], [], [], []
    for row in range(batch):
        block, grid = _image_block(config, row)
        if row == 0 and image_tokens_delta:
            position = block.index(IMAGE)
            block = (
                block[:position]
                + [IMAGE] * max(0, block.count(IMAGE) + image_tokens_delta)
                + [t for t in block[position:] if t != IMAGE]
            )
        pad = 3 if row % 2 == 0 else 0
        before = torch.randint(3, 128, (3,), generator=gen).tolist()
        after = torch.randint(3, 128, (seq - pad - 1 - len(before) - len(block),), generator=gen).tolist()
        ids = [0] * pad + [1] + before + block + after
        rows.append(ids)
        types.append([1 if t == IMAGE else 0 for t in ids])
        if grid:
            t, h, w = grid
            vision = config.vision_config
            width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
            images.append(torch.randn(t * h * w, width, generator=gen))
            grids.append(grid)
        else:
            size = config.vision_config.image_size
            images.append(torch.randn(1, 3, size, size, generator=gen))
    input_ids = torch.tensor(rows)
    attention_mask = (torch.arange(seq) >= torch.tensor([3 if r % 2 == 0 else 0 for r in range(batch)])[:, None]).long()
    labels = input_ids.clone()
    labels[(attention_mask == 0) | (input_ids == IMAGE)] = -100
    labels[:, 1:][attention_mask[:, :-1] == 0] = -100  # predicted from a padding position: no target (as cp_batch)
    labels[:, seq // 2] = -100
    inputs = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "pixel_values": torch.cat(images),
        "labels": labels,
    }
    if grids:
        inputs["image_grid_thw"] = torch.tensor(grids)
        inputs["mm_token_type_ids"] = torch.tensor(types)
    if config.model_type == "gemma3":
        inputs["token_type_ids"] = torch.tensor(types)
    return inputs


def save_tiny_vlm(directory, model_type: str, seed: int = 0) -> str:
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(TINY_VLM_CONFIGS[model_type]()).save_pretrained(directory)
    return str(directory)


def load_vlm(model_dir: str):
    model = AutoModelForImageTextToText.from_pretrained(model_dir, attn_implementation="eager").float()
    model.eval()  # no dropout: identical math on every rank
    return model


def held_fraction(model, reference) -> float:
    """This rank's parameter elements over the one-process model's."""
    return sum(p.numel() for p in model.parameters()) / sum(p.numel() for p in reference.parameters())
