"""GPT-NeoX (Pythia): the fused `query_key_value` is interleaved per head ([q_h | k_h | v_h] for each
head h), so a plain split in whole heads is already a valid local fused projection. Its layers are a decoder stack
with a final norm: pipeline stages and sequence parallelism from its structure (both norms of a layer on the
sequence slices, attention and MLP on the whole sequence)."""

from __future__ import annotations

from optimum_parallel import Capabilities

from ._common import DecoderParallelizer, with_structural_sequence_parallel


class GPTNeoXParallelizer(DecoderParallelizer):
    capabilities = Capabilities(
        sequence_parallel=True,
        pipeline_parallel=True,
        refusals=(("context", "its fused query_key_value attention has no key/value groups the cp split routes"),),
    )
    layer = r"layers\.\d+\."
    qkv_proj, out_proj = r"attention\.query_key_value", r"attention\.dense"
    mlp_in, mlp_out = r"mlp\.dense_h_to_4h", r"mlp\.dense_4h_to_h"
    embedding = "embed_in"
    lm_head = "(lm_head|embed_out)"

    @classmethod
    def plan(cls, model, mesh, parallelize_embeddings, sequence_parallel_enabled):
        plan = super().plan(model, mesh, parallelize_embeddings, False)
        return with_structural_sequence_parallel(model, plan) if sequence_parallel_enabled else plan
