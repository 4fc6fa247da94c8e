"""OPT: separate q/k/v (with biases) and out_proj, fc1/fc2; learned positions stay replicated. The
attention reshapes with `self.num_heads`, which the engine makes local after the swap."""

from __future__ import annotations

from ._common import DecoderParallelizer


class OPTParallelizer(DecoderParallelizer):
    decoder = r"decoder\."
    layer = r"layers\.\d+\."
    qkv_proj, out_proj = r"self_attn\.(q|k|v)_proj", r"self_attn\.out_proj"
    mlp_in, mlp_out = "fc1", "fc2"
    embedding = "embed_tokens"
