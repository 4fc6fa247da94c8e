"""Gemma 4 with per-layer inputs (`hidden_size_per_layer_input > 0`, as in the small Gemma 4 models) against one
process on the whole batch (gloo, 4 ranks): loss, every gradient, the loss over 3 AdamW steps.

The base model computes a per-layer input for every token and layer before the layers (`embed_tokens_per_layer` on the
token ids, `per_layer_model_projection` and `per_layer_projection_norm` on the input embeddings) and hands layer i
`per_layer_inputs[:, :, i, :]`. Under sp each tp rank's layers take their slice of the sequence, under cp the chunks the
cp split gives the rank, under pp the first stage computes them and they travel with the hidden states to the stages
holding later layers (the embedding and projection get gradient from every layer on every stage); with sp, pp x sp,
pp x cp and cp x sp too. Layers reading the keys and values an earlier layer stored (`num_kv_shared_layers`, the small
models' other trait) are refused by name at pp and cp. The family matrix's
`gemma4_text` (hidden_size_per_layer_input=0, as the large Gemma 4 models) stays as it is; this variant is the same
tiny model with per-layer inputs of width 16 (2 layers: at pp=2 the second layer's inputs travel to the second stage).
"""

from __future__ import annotations

from functools import cache

import pytest
from family_matrix import BASE, FAMILIES, batch_for, build, check_layout, noise_floor, tolerance, verdict
from transformers import AutoConfig

WORLD_SIZE = 4
MODEL_TYPE = "gemma4_text"
LAYOUTS = {
    "tp2+sp": dict(mesh=dict(dp=2, tp=2), sequence_parallel=True),
    "pp2": dict(mesh=dict(dp=2, pp=2), microbatches=2),
    "cp2": dict(mesh=dict(dp=2, cp=2)),
    "tp2xdp2-L3": dict(mesh=dict(dp=2, tp=2), level=3),
    "pp2xdp2-L3": dict(mesh=dict(dp=2, pp=2), microbatches=2, level=3),
    "pp2xtp2+sp": dict(mesh=dict(pp=2, tp=2), sequence_parallel=True, microbatches=2),
    "pp2xcp2": dict(mesh=dict(pp=2, cp=2), microbatches=2),
    "cp2xtp2+sp": dict(mesh=dict(cp=2, tp=2), sequence_parallel=True),
}


def per_layer_config():
    overrides = dict(
        FAMILIES[MODEL_TYPE],
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=BASE["vocab_size"],
    )
    return AutoConfig.for_model(MODEL_TYPE, **{**BASE, **overrides})


def kv_shared_config():
    """The small Gemma 4 models' other trait: the last layers read the keys and values earlier layers stored."""
    overrides = dict(
        FAMILIES[MODEL_TYPE],
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=BASE["vocab_size"],
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2,
    )
    return AutoConfig.for_model(MODEL_TYPE, **{**BASE, **overrides})


def check(layout: str, kv_shared: bool = False) -> dict:
    config = kv_shared_config() if kv_shared else per_layer_config()
    return check_layout(MODEL_TYPE, layout, config=config, spec=LAYOUTS[layout])


@cache
def floor() -> dict[str, float]:
    return noise_floor(MODEL_TYPE, config=per_layer_config())


def eval_logits_error(layout: str) -> float | None:
    """`run_eval`'s logits at a pipeline layout against one process's at the real tokens (None on the ranks without the
    last stage)."""
    import optimum_parallel as op

    op.init_mesh(**LAYOUTS[layout]["mesh"], timeout=60)
    config = per_layer_config()
    reference, batch = build(config), batch_for(config)
    model = build(per_layer_config())  # a config of its own: cp sets the attention implementation on it
    model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(
        model, pipeline_parallel_num_microbatches=LAYOUTS[layout]["microbatches"]
    )
    logits = model.run_eval(**batch).logits
    if logits is None:
        return None
    real = batch["attention_mask"].bool()  # a padding position's output no two attentions define alike
    logits, expected = logits[real], reference(**batch).logits[real]
    return ((logits - expected).abs().max() / expected.abs().max()).item()


def test_config_has_per_layer_inputs():
    model = build(per_layer_config())
    assert model.model.embed_tokens_per_layer.weight.shape == (BASE["vocab_size"], BASE["num_hidden_layers"] * 16)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_per_layer_inputs_equal_one_process(pool, layout):
    results = pool.run(check, layout)
    outcome, detail = verdict(results, floor())
    worst = {k: max(r["errors"][k] for r in results) for k in ("loss", "grad", "steps")} if outcome != "refused" else {}
    print(f"gemma4 per-layer inputs {layout}: {outcome} {detail} {worst} held={results[0].get('held')}")
    assert outcome == "equal", f"{layout}: {outcome} {detail} ({results[0]})"
    if results[0].get("held") is not None and "pp" not in layout:  # at tp the per-layer table is split too
        assert results[0]["held"] <= 0.51, results[0]["held"]


@pytest.mark.parametrize("layout", ["pp2", "cp2"])
def test_kv_shared_layers_refused_by_name(pool, layout):
    """Keys and values stored by one layer and read by a later one cross pp stages and cp chunks: refused on every
    rank before anything changes, naming the first layer reading them."""
    outcome, detail = verdict(pool.run(check, layout, True), floor())
    assert outcome == "refused", detail
    assert "model.layers.2.self_attn" in detail and "num_kv_shared_layers=2" in detail and "allowed" in detail, detail


@pytest.mark.parametrize("layout", ["pp2", "pp2xcp2"])
def test_pipeline_eval_logits(pool, layout):
    """The forward-only path (`run_eval`, every travelling tensor sent with a header) carries them too."""
    errors = [e for e in pool.run(eval_logits_error, layout) if e is not None]
    print(f"gemma4 per-layer inputs run_eval {layout}: logits {max(errors, default=float('nan')):.1e}")
    assert errors and max(errors) <= tolerance(floor()), errors
