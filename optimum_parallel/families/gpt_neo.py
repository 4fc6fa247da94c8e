"""GPT-Neo: separate q/k/v and out_proj, global and local (windowed) attention layers alike; the
attention reshapes with `self.num_heads`, which the engine makes local after the swap."""

from __future__ import annotations

from ._common import DecoderParallelizer


class GPTNeoParallelizer(DecoderParallelizer):
    heads_attribute = "num_heads"
    layer = r"h\.\d+\."
    qkv_proj, out_proj = r"attn\.attention\.(q|k|v)_proj", r"attn\.attention\.out_proj"
    mlp_in, mlp_out = r"mlp\.c_fc", r"mlp\.c_proj"
    embedding = "wte"
