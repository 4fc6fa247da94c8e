"""GPT-NeoX (Pythia): the fused `query_key_value` is interleaved per head ([q_h | k_h | v_h] for each
head h), so a plain split in whole heads is already a valid local fused projection."""

from __future__ import annotations

from ._common import DecoderParallelizer


class GPTNeoXParallelizer(DecoderParallelizer):
    layer = r"layers\.\d+\."
    qkv_proj, out_proj = r"attention\.query_key_value", r"attention\.dense"
    mlp_in, mlp_out = r"mlp\.dense_h_to_4h", r"mlp\.dense_4h_to_h"
    embedding = "embed_in"
    lm_head = "(lm_head|embed_out)"
