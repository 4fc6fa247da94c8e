"""Packed documents through the mixers that carry a state (gated delta net, Mamba2, Mamba1, short convolution), on
every layout, against each document run alone on one device: loss, every gradient, the documents' logits and the loss
after an AdamW step. Rows of 3 documents (10, 17, 7 and 21, 6, 4 tokens; the second row ends with padding), marked
by restarting position_ids; 4 gloo ranks (every dp replica gets the whole batch, so the averages are exact).

Without the mixers' runner (`optimum_parallel/mixers/`) the recurrent and convolution states crossed the documents:
the loss was close, the gradients 41-131% off."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from family_matrix import _err, _module_scales, build, family_config
from test_packing import _expected, _spans, _whole, alone, documents, packed_batch

WORLD_SIZE = 4
TOL = 1e-5
FAMILIES = {  # one family per kind of mixer
    "qwen3_5_text": "gated delta net",
    "falcon_h1": "Mamba2 (beside attention in every layer)",
    "jamba": "Mamba1",
    "lfm2": "short convolution",
}
LAYOUTS = {
    "dp4": dict(),
    "tp2+sp": dict(tp=2, sequence_parallel=True),
    "pp2": dict(pp=2),
    "cp2": dict(cp=2),
    "cp2xtp2": dict(cp=2, tp=2),
}


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """A loss's or the logits' error; a gradient's is measured on its module's largest gradient (`_err`): a
    delta net's A_log has heads whose gradient is ~1e-9, fp32 rounding noise at the module's scale."""
    actual, expected = actual.detach().double(), expected.detach().double()
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


def check_packed_hybrid(model_type: str, tp: int = 1, pp: int = 1, cp: int = 1, sequence_parallel: bool = False):
    """Errors of the parallel model on the packed rows against the documents run alone."""
    import optimum_parallel as op
    from optimum_parallel.engine.compose import compose_training

    dp = dist.get_world_size() // (tp * pp * cp)
    mesh = op.init_mesh(dp=dp, tp=tp, pp=pp, cp=cp, timeout=60)
    config = family_config(model_type)
    reference = build(config)
    model = copy.deepcopy(reference)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    if tp > 1 or pp > 1 or cp > 1:
        parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
        model = parallelizer.parallelize(
            model, sequence_parallel_enabled=sequence_parallel, pipeline_parallel_num_microbatches=2 if pp > 1 else 1
        )
        optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
        model, optimizer = compose_training(model, optimizer, mesh, {}, op.DataParallelConfig(0))
    else:
        model, optimizer = op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": 0}})

    docs = documents(config)
    batch = packed_batch(docs)
    ref_loss, ref_logits = alone(reference, docs)
    ref_loss.backward()
    loss = model.run_train(**batch) if pp > 1 else model(**batch).loss
    if pp == 1:
        loss.backward()
    expected = dict(reference.named_parameters())
    scales = _module_scales(reference)
    grads = {
        name: _err(_whole(p.grad), _expected(p, expected[name].grad), scales[name.rpartition(".")[0]])
        for name, p in model.named_parameters()
    }
    worst = max(grads, key=grads.get)
    out = {"loss": _rel(loss, ref_loss), "grad": grads[worst], "worst": worst}
    with torch.no_grad():
        logits = model.run_eval(**batch).logits if pp > 1 else model(**batch).logits
    if logits is not None:
        from _models import whole_logits

        logits = whole_logits(model, logits)
        got = torch.cat([logits[r, s:e] for r, s, e in _spans(docs, False)])
        out["logits"] = _rel(got, torch.cat([x for row in ref_logits for x in row]))
    for opt in (optimizer, ref_optimizer):
        opt.step()
        opt.zero_grad()
    ref_loss = alone(reference, docs)[0]
    loss = model.run_train(**batch) if pp > 1 else model(**batch).loss
    out["step"] = _rel(loss, ref_loss)
    return out


CASES = [(t, layout) for t in FAMILIES for layout in LAYOUTS]


@pytest.mark.parametrize("model_type,layout", CASES, ids=[f"{t}-{lay}" for t, lay in CASES])
def test_packed_documents_stay_apart_in_every_mixer(pool, model_type, layout):
    results = pool.run(check_packed_hybrid, model_type, **LAYOUTS[layout])
    first = results[0]
    print(f"\n{model_type} ({FAMILIES[model_type]}) at {layout}: {first}")
    for rank, result in enumerate(results):
        worst = max(result["loss"], result["grad"], result.get("logits", 0.0), result["step"])
        assert worst <= TOL, f"rank {rank}: {result}"


def packed_without_runner(model_type: str) -> str:
    """A packed forward through a mixer whose decoder gives it no marker: refused, naming the layer."""
    import optimum_parallel as op
    from optimum_parallel.mixers import marker

    op.init_mesh(dp=dist.get_world_size(), timeout=60)
    config = family_config(model_type)
    model = build(config)
    model, _ = op.parallelize(model, None, None, {"dp_config": {"sharding_level": 0}})
    decoder = model.module.model if hasattr(model, "module") else model.model
    namespace = marker._namespace(decoder)
    patched = namespace[marker.MASK_FUNCTION]
    namespace[marker.MASK_FUNCTION] = patched._optimum_parallel_original  # as a family that builds its own mask
    try:
        model(**packed_batch(documents(config)))
    except RuntimeError as err:
        return str(err)
    finally:
        namespace[marker.MASK_FUNCTION] = patched
    return "ran"


def test_a_mixer_that_gets_no_documents_refuses_packed_rows(pool):
    errors = pool.run(packed_without_runner, "qwen3_5_text")
    assert all("model.layers.0.linear_attn (Qwen3_5GatedDeltaNet) got no sequence marker" in e for e in errors), errors
