"""The LM head scored a chunk of tokens at a time (issue 49): `head_token_scores` (hidden states x this rank's slice of
the head, never the tokens x V_local logits), the chunked `token_log_probs` / `token_statistics`, and the parallel
fused head that TRL's trainers call, equal to the unchunked result and to one device within fp32 noise: per-token
log-probabilities, entropy, log sum p^2, mean logit, top-1, the loss and every gradient, with ignored labels, left and
right padding, chunks that do not divide the tokens, logit scale, softcapping and temperature; at tp=1, tp=2 (uneven
vocabulary split), tp=2 + sp and cp=2 (2 ranks, gloo)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _models import rel_err, tiny_config

from optimum_parallel.tensor_parallel import logprobs
from optimum_parallel.tensor_parallel.logprobs import (
    LogitTransform,
    head_token_scores,
    token_log_probs,
    token_statistics,
)

WORLD_SIZE = 2
TOL = 1e-5  # relative, fp32 against float64 or against the unchunked fp32 path
VOCAB, HIDDEN = 37, 16  # 37 over 2 ranks: 19 + 18
SCORES = ("log_prob", "entropy", "mean_logit", "log_sum_sq_probs", "correct")
TRANSFORMS = {
    "plain": LogitTransform(),
    "scaled-tempered": LogitTransform(scale=0.5, temperature=0.7),
    "softcapped": LogitTransform(scale=2.0, softcap=3.0, temperature=1.3),
}


def head_inputs(seed: int = 0):
    """hidden (3, 7, H), an LM head (V, H) with bias, labels with ignored tokens, an argmax hit and a tie before the
    label (argmax takes the first maximum), per-token weights for the backward."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 7, HIDDEN, generator=gen)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5
    bias = torch.randn(VOCAB, generator=gen) * 0.1
    labels = torch.randint(0, VOCAB, (3, 7), generator=gen)
    labels[0, :3] = -100
    labels[2, 6] = -100
    weight[30] = weight[4]  # ids 4 and 30 tie on every token; the label 30 is then never the argmax
    bias[30] = bias[4] = 5.0
    labels[1, 2] = 30
    logits = hidden @ weight.T + bias
    labels[1, 0] = logits[1, 0].argmax()
    weights = torch.linspace(0.5, 2.0, labels.numel()).reshape(labels.shape)
    return hidden, weight, bias, labels, weights


def reference(hidden, weight, bias, labels, weights, transform: LogitTransform) -> dict:
    """float64 log_softmax on the whole logits: the scores and the gradients of sum(weight x log p)."""
    hidden, weight, bias = (t.double().requires_grad_() for t in (hidden, weight, bias))
    y = (hidden @ weight.T + bias) * transform.scale
    if transform.softcap is not None:
        y = transform.softcap * torch.tanh(y / transform.softcap)
    z = y / transform.temperature
    log_p = z.log_softmax(-1)
    mask = labels != -100
    picked = log_p.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * mask
    (picked * weights.double()).sum().backward()
    return {
        "log_prob": picked.detach(),
        "entropy": (-(log_p.exp() * log_p).sum(-1) * mask).detach(),
        "mean_logit": (z.mean(-1) * mask).detach(),
        "log_sum_sq_probs": (log_p.exp().square().sum(-1).log() * mask).detach(),
        "correct": (z.argmax(-1) == labels) & mask,
        "hidden": hidden.grad,
        "weight": weight.grad,
        "bias": bias.grad,
    }


def scored(hidden, weight, bias, labels, weights, transform, group=None, start=0, chunk_elements=None) -> dict:
    hidden, weight, bias = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    stats = head_token_scores(
        hidden, weight, bias, labels, group, start, VOCAB, transform, chunk_elements=chunk_elements
    )
    (stats.log_prob * weights).sum().backward()
    out = {name: getattr(stats, name) for name in SCORES}
    return {**out, "log_prob": stats.log_prob.detach(), "hidden": hidden.grad, "weight": weight.grad, "bias": bias.grad}


def assert_close(got: dict, expected: dict, names) -> None:
    for name in names:
        if got[name].dtype == torch.bool:
            assert torch.equal(got[name], expected[name]), name
        else:
            assert rel_err(got[name], expected[name]) <= TOL, (name, rel_err(got[name], expected[name]))


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("chunk_elements", [VOCAB * 4, VOCAB, None], ids=["4-tokens", "1-token", "one-chunk"])
def test_head_scores_on_one_rank_match_log_softmax(transform, chunk_elements):
    inputs = head_inputs()
    expected = reference(*inputs, TRANSFORMS[transform])
    assert expected["correct"][1, 0] and not expected["correct"][1, 2]
    got = scored(*inputs, TRANSFORMS[transform], chunk_elements=chunk_elements)
    assert_close(got, expected, (*SCORES, "hidden", "weight", "bias"))
    assert not any(got[name].requires_grad for name in SCORES)  # the other fields carry no gradient


def test_chunk_size_changes_nothing_but_rounding():
    """Chunk sizes change only which tokens share a matmul: the scores agree to fp32 rounding."""
    inputs = head_inputs(3)
    one = scored(*inputs, TRANSFORMS["softcapped"], chunk_elements=10**9)
    many = scored(*inputs, TRANSFORMS["softcapped"], chunk_elements=VOCAB * 2)
    for name in (*SCORES, "hidden", "weight", "bias"):
        if one[name].dtype == torch.bool:
            assert torch.equal(one[name], many[name])
        else:
            assert rel_err(many[name], one[name]) <= 1e-6, name


def test_no_gradient_asked_for_none_computed():
    hidden, weight, bias, labels, _ = head_inputs()
    stats = head_token_scores(hidden, weight, None, labels)
    assert not stats.log_prob.requires_grad
    with torch.no_grad():
        frozen = head_token_scores(hidden.requires_grad_(), weight, None, labels)
    assert not frozen.log_prob.requires_grad
    nothing, leaf = torch.zeros(0, HIDDEN, requires_grad=True), weight.clone().requires_grad_()
    head_token_scores(nothing, leaf, None, labels[:0, 0]).log_prob.sum().backward()
    assert torch.equal(leaf.grad, torch.zeros_like(weight))  # no labelled token: a zero gradient, not an error


def test_under_autocast_the_projection_runs_in_its_dtype_the_reductions_in_fp32():
    """bf16 autocast (as TRL's trainers run with bf16=True): the product in bf16 in both passes, the gradients in the
    inputs' dtype, within bf16 rounding of float64."""
    inputs = head_inputs(4)
    expected = reference(*inputs, TRANSFORMS["scaled-tempered"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = scored(*inputs, TRANSFORMS["scaled-tempered"], chunk_elements=VOCAB * 4)
    assert got["log_prob"].dtype == torch.float32 and got["weight"].dtype == torch.float32
    for name in ("log_prob", "entropy", "hidden", "weight", "bias"):
        assert rel_err(got[name], expected[name]) <= 3e-2, (name, rel_err(got[name], expected[name]))


@pytest.mark.parametrize("chunk_elements", [VOCAB * 3, None], ids=["3-tokens", "one-chunk"])
def test_chunked_logits_functions_match_log_softmax(chunk_elements):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 5, VOCAB, generator=gen) * 3
    labels = torch.randint(0, VOCAB, (4, 5), generator=gen)
    labels[0, :2] = -100
    weights = torch.linspace(0.5, 2.0, labels.numel()).reshape(labels.shape)
    mask = labels != -100
    whole = logits.double().requires_grad_()
    log_p = whole.log_softmax(-1)
    picked = log_p.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * mask
    (picked * weights.double()).sum().backward()
    local = logits.clone().requires_grad_()
    got = token_log_probs(local, labels, chunk_elements=chunk_elements)
    (got * weights).sum().backward()
    assert rel_err(got, picked) <= TOL and rel_err(local.grad, whole.grad) <= TOL
    assert torch.equal(logits, local.detach())  # the caller's logits are not overwritten
    stats = token_statistics(logits, labels, chunk_elements=chunk_elements)
    assert rel_err(stats.entropy, -(log_p.exp() * log_p).sum(-1) * mask) <= TOL
    assert rel_err(stats.log_prob, picked) <= TOL
    assert torch.equal(stats.correct, (logits.argmax(-1) == labels) & mask)


def test_chunk_size_follows_the_local_vocabulary():
    assert logprobs.chunk_tokens(128256) == logprobs.CHUNK_ELEMENTS // 128256  # 261 tokens, 128 MiB at fp32
    assert logprobs.chunk_tokens(64128) >= 2 * logprobs.chunk_tokens(128256)  # tp=2: twice the tokens a chunk
    assert logprobs.chunk_tokens(10**12) == 1 and logprobs.chunk_tokens(37, 100) == 2


# ------------------------------------------------------------------------------------------------ 2 ranks


def split_head(transform: str, chunk_elements: int | None) -> dict:
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    hidden, weight, bias, labels, weights = head_inputs(1)
    start, stop = (0, 19) if rank == 0 else (19, VOCAB)
    got = scored(hidden, weight[start:stop], bias[start:stop], labels, weights, TRANSFORMS[transform], group, start,
                 chunk_elements)  # fmt: skip
    return {**got, "range": (start, stop)}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_vocab_parallel_head_scores_match_one_device(pool, transform):
    inputs = head_inputs(1)
    expected = reference(*inputs, TRANSFORMS[transform])
    results = pool.run(split_head, transform, 19 * 4)  # 4 tokens a chunk on each rank: 21 tokens, 6 chunks
    for r in results:
        assert_close(r, expected, SCORES)
    # the hidden states' gradient is each rank's part (the tp region's entry sums them)
    assert rel_err(sum(r["hidden"] for r in results), expected["hidden"]) <= TOL
    assert rel_err(torch.cat([r["weight"] for r in results]), expected["weight"]) <= TOL
    assert rel_err(torch.cat([r["bias"] for r in results]), expected["bias"]) <= TOL


# ------------------------------------------------------------------------------------- the parallel fused head


def fused_batch(vocab: int) -> dict[str, torch.Tensor]:
    """Left padding (row 0), right padding (row 1), an ignored label in the middle; the token right after the left
    padding is not scored (one device attends it to masked keys, ring attention to none)."""
    gen = torch.Generator().manual_seed(1)
    length = 30
    input_ids = torch.randint(0, vocab, (2, length), generator=gen)
    mask = torch.ones(2, length, dtype=torch.long)
    labels = input_ids.clone()
    mask[0, :3] = 0
    labels[0, :4] = -100
    mask[1, -4:] = 0
    labels[1, -4:] = -100
    labels[:, length // 2] = -100
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits")


def fused_check(layout: dict, sequence_parallel: bool = False) -> dict:
    """The parallel fused head (chunked: a few tokens a chunk) against TRL's fused head on one device, and against
    the parallel model's own unchunked path, on the same weights and batch: per-token fields, loss, gradients."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    import optimum_parallel as op
    from optimum_parallel.engine.compose import compose_training
    from optimum_parallel.integrations.trl import fused_head

    temperature = 0.7
    mesh = op.init_mesh(**layout)
    config = tiny_config("llama")
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    model = copy.deepcopy(reference)
    model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(
        model, sequence_parallel_enabled=sequence_parallel
    )
    model, _ = compose_training(model, None, mesh, {}, op.DataParallelConfig(sharding_level=0))
    fused_head.install_fused_head(model, temperature)
    assert fused_head.head_projection(model) is not None  # the chunked path
    add_fused_lm_head(reference, temperature=temperature, outputs=tuple(FIELDS[1:]) + ("is_top1",))
    batch = fused_batch(config.vocab_size)
    weights = torch.linspace(0.5, 2.0, 2 * 29).reshape(2, 29)

    def run(m) -> tuple[dict, dict]:
        m.zero_grad(set_to_none=True)
        out = m(**batch, fused_lm_head=True)
        (out.loss + (out.log_probs * weights).sum()).backward()
        fields = {name: getattr(out, name).detach() for name in FIELDS}
        fields.update(loss=out.loss.detach(), is_top1=out.is_top1, label_mask=out.label_mask)
        return fields, {name: p.grad.clone() for name, p in m.named_parameters()}

    previous = logprobs.CHUNK_ELEMENTS
    logprobs.CHUNK_ELEMENTS = 5 * config.vocab_size  # 5 tokens a chunk at tp=1, 10 at tp=2
    try:
        chunked, chunked_grads = run(model)
    finally:
        logprobs.CHUNK_ELEMENTS = previous
    expected, expected_grads = run(reference)
    projection, fused_head.head_projection = fused_head.head_projection, lambda model: None
    try:
        unchunked, unchunked_grads = run(model)  # the model's own forward, whole local logits
    finally:
        fused_head.head_projection = projection

    errors, unchunked_errors = {}, {}
    for name in (*FIELDS, "loss"):
        errors[name] = rel_err(chunked[name], expected[name])
        unchunked_errors[name] = rel_err(chunked[name], unchunked[name])
    for name in ("is_top1", "label_mask"):
        errors[name] = float(not torch.equal(chunked[name], expected[name]))
        unchunked_errors[name] = float(not torch.equal(chunked[name], unchunked[name]))
    errors["label_mask"] += float(not torch.equal(chunked["label_mask"], batch["labels"][:, 1:] != -100))
    params = dict(model.named_parameters())
    for name, grad in chunked_grads.items():
        layout_ = getattr(params[name], "shard_layout", None)
        full = expected_grads[name]
        errors[f"grad {name}"] = rel_err(grad, layout_.slice(full) if layout_ is not None else full)
        unchunked_errors[f"grad {name}"] = rel_err(grad, unchunked_grads[name])
    return {"trl": errors, "unchunked": unchunked_errors, "grads": len(chunked_grads)}


LAYOUTS = {
    "tp1": ({"dp": 2}, False),  # both replicas get the same batch: the average is the one-device gradient
    "tp2": ({"tp": 2}, False),
    "tp2-sp": ({"tp": 2}, True),
    "cp2": ({"cp": 2}, False),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_fused_head_matches_trl_and_the_unchunked_path(pool, layout):
    for rank, result in enumerate(pool.run(fused_check, *LAYOUTS[layout])):
        assert result["grads"] >= 20
        for against in ("trl", "unchunked"):
            worst = max(result[against], key=result[against].get)
            assert result[against][worst] <= TOL, (layout, rank, against, worst, result[against][worst])
