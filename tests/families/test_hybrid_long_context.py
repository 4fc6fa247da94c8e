"""Context parallelism through every kind of mixer that carries a state, on a sequence long enough that each rank
holds several of the mixer's chunks (300 tokens: 150 a rank; the gated delta rule's chunks are 64 tokens, the Mamba2
scans' 8 in these tiny configs, neither dividing a rank's share), with left padding and -100 labels: loss, every
gradient and the loss over 3 AdamW steps against one process on the whole batch (2 gloo ranks, cp=2). Then what cp
cannot split: a mixer's heads that tp x cp does not divide is refused before anything changes, naming the layer and
the sizes that would run."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from family_matrix import BASE, FAMILIES, _compare, _err, _module_scales, build, family_config
from transformers import AutoConfig

WORLD_SIZE = 2
SEQ = 300
TOL = 1e-5
NOISE_FACTOR = 10  # a gradient's tolerance: max(TOL, this x its change when the weights move by relative 1e-7)
KINDS = {
    "qwen3_5_text": "gated delta net (Qwen3.5)",
    "qwen3_next": "gated delta net, interleaved projections (Qwen3-Next)",
    "kimi_linear": "Kimi delta attention",
    "falcon_h1": "Mamba2 beside attention (Falcon-H1)",
    "bamba": "Mamba2 with a gated norm over groups (Bamba)",
    "jamba": "Mamba1 (Jamba)",
    "lfm2": "short convolution (LFM2)",
}


def long_batch(config, rows: int = 2) -> dict[str, torch.Tensor]:
    """Rows of SEQ tokens, row 0 left-padded by 5, -100 on padding, after it and at two more places."""
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, config.vocab_size, (rows, SEQ), generator=gen)
    attention_mask = torch.ones(rows, SEQ, dtype=torch.long)
    attention_mask[0, :5] = 0
    input_ids[attention_mask == 0] = config.pad_token_id
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[0, 5] = -100  # predicted from a padding position
    labels[:, [SEQ // 3, SEQ - 7]] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _config(model_type: str):
    config = family_config(model_type)
    config.max_position_embeddings = 2 * SEQ
    return config


def _grads(model, batch) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(**batch).loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def noise_floor(model_type: str) -> dict[str, float]:
    """Each gradient's change (on its module's scale) when one process starts from weights perturbed by relative
    1e-7, on the long batch: fp32's own noise there (high for a delta net's A_log whose heads' gradients cancel)."""
    config = _config(model_type)
    reference, perturbed = build(config), build(config)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in perturbed.parameters():
            param.mul_(1 + 1e-7 * torch.randn(param.shape, generator=gen))
    batch = long_batch(config)
    expected, moved = _grads(reference, batch), _grads(perturbed, batch)
    reference.zero_grad()
    reference(**batch).loss.backward()
    scales = _module_scales(reference)
    return {n: _err(moved[n], g, scales[n.rpartition(".")[0]]) for n, g in expected.items()}


def check_long(model_type: str, checkpointing: bool = False) -> dict:
    import optimum_parallel as op
    from optimum_parallel.engine.compose import compose_training

    mesh = op.init_mesh(cp=dist.get_world_size(), timeout=60)
    config = _config(model_type)
    reference = build(config)
    floor = noise_floor(model_type)
    model = copy.deepcopy(reference)
    if checkpointing:  # each layer runs again in the backward: the mixers' marker travels in their arguments
        for each in (reference, model):
            each.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            each.train()  # no dropout in these configs: the same math as eval
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model)
    optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
    heads = {n: m.__dict__["_optimum_parallel_mixer"].heads for n, m in model.named_modules()
             if "_optimum_parallel_mixer" in m.__dict__}  # fmt: skip
    model, optimizer = compose_training(model, optimizer, mesh, {}, op.DataParallelConfig(0))
    errors = _compare(reference, model, optimizer, long_batch(config), pipeline=False, per_parameter=True)
    over = {n: (e, floor[n]) for n, e in errors.pop("grads").items() if e > max(TOL, NOISE_FACTOR * floor[n])}
    return {"errors": errors, "over": over, "heads": heads}


CASES = [(t, False) for t in KINDS] + [("qwen3_5_text", True), ("falcon_h1", True)]


@pytest.mark.parametrize("model_type,checkpointing", CASES, ids=[t + ("-ckpt" if c else "") for t, c in CASES])
def test_context_parallel_over_several_mixer_chunks(pool, model_type, checkpointing):
    results = pool.run(check_long, model_type, checkpointing)
    print(f"\n{KINDS[model_type]} at cp=2, {SEQ} tokens: {results[0]['errors']}; heads split: {results[0]['heads']}")
    assert results[0]["heads"] and all(results[0]["heads"].values()), results[0]["heads"]
    for rank, result in enumerate(results):
        assert not result["over"], f"rank {rank}: gradients over max(1e-5, 10 x their noise floor): {result}"
        assert max(result["errors"]["loss"], result["errors"]["steps"]) <= TOL, f"rank {rank}: {result}"


def _refusal(model_type: str, overrides: dict, sizes: dict) -> str:
    from functools import partial

    import optimum_parallel as op
    from optimum_parallel.engine.checks import validate
    from optimum_parallel.engine.layouts import layout_mesh
    from optimum_parallel.engine.request import ParallelRequest
    from optimum_parallel.frontends.family_request import family_request

    config = AutoConfig.for_model(model_type, **{**BASE, **FAMILIES[model_type], **overrides})
    model = build(config)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    family = op.ParallelizersManager.parallelizer_for_model(model)
    with pytest.raises(ValueError) as refused:
        validate(ParallelRequest(), model, layout_mesh(sizes), partial(family_request, family))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    return str(refused.value)


def test_heads_cp_cannot_split_are_refused_before_anything_changes():
    message = _refusal("qwen3_5_text", {"linear_num_value_heads": 6, "linear_num_key_heads": 2}, {"cp": 4})
    assert "model.layers.0.linear_attn" in message and "6 heads" in message, message
    assert "context_parallel_size=4" in message and "allowed context_parallel_size: [1, 2, 3, 6" in message, message
    message = _refusal("falcon_h1", {}, {"cp": 8, "tp": 2})
    assert "model.layers.0.mamba" in message and "tensor_parallel_size=2 x context_parallel_size=8" in message
