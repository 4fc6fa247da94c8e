"""Inference on a tensor-parallel model against the real single-device transformers model (gloo, 4 ranks).

Full-vocabulary logits wherever a caller reads them (identical on every tp rank), local logits and the
vocab-parallel loss in training with labels, and `generate` -- greedy, beam search, sampling -- giving the
single-device tokens on every rank, with the KV cache and a left-padded batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _checks import TOL
from _models import build_model, make_batch, rel_err, tiny_config
from test_families import AUTO, FAMILIES, TOKENS
from transformers import AutoConfig

WORLD_SIZE = 4
NEW_TOKENS = 6
GREEDY = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
BEAMS = dict(max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=3, pad_token_id=0)
SAMPLING = dict(max_new_tokens=NEW_TOKENS, do_sample=True, top_k=0, pad_token_id=0)


def _parallel_pair(config, tp: int, kind: str = "causal", sequence_parallel: bool = False):
    import optimum_parallel as op

    mesh = op.init_mesh(dp=dist.get_world_size() // tp, tp=tp)
    torch.manual_seed(0)
    reference = AUTO[kind].from_config(config, attn_implementation="eager").float().eval()
    parallel = copy.deepcopy(reference)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(parallel)
    parallel = parallelizer.parallelize(parallel, sequence_parallel_enabled=sequence_parallel)
    return mesh, reference, parallel, parallelizer.__name__


def _prompts(config, seq: int = 12):
    batch = make_batch(config, batch=2, seq=seq)
    batch["input_ids"] = batch["input_ids"].clamp_min(3)  # no early eos / pad in the prompt itself
    return batch


def _generations(reference, parallel, mesh, inputs: dict) -> dict:
    """Greedy, beam search and sampling on both models; sampling seeded differently on every tp rank but 0."""
    found = {}
    for name, options in (("greedy", GREEDY), ("beams", BEAMS)):
        found[name] = (parallel.generate(**inputs, **options), reference.generate(**inputs, **options))
    torch.manual_seed(7)
    expected = reference.generate(**inputs, **SAMPLING)
    torch.manual_seed(7 + 100 * mesh.rank("tp"))  # tp rank 0 of every group: the reference's seed
    found["sampling"] = (parallel.generate(**inputs, **SAMPLING), expected)
    return {name: (got.tolist(), want.tolist()) for name, (got, want) in found.items()}


def check_causal(config, tp: int, sequence_parallel: bool = False, kind: str = "causal") -> dict:
    """Logits in every mode against the reference, then the three decoding strategies."""
    import optimum_parallel as op

    mesh, reference, parallel, name = _parallel_pair(config, tp, kind, sequence_parallel)
    batch = _prompts(config)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    result = {"parallelizer": name}
    with torch.no_grad():
        ref = reference(**batch)
        out = parallel(**inputs)  # no labels: full logits
        result["logits"] = rel_err(out.logits, ref.logits)
        result["logits_checksum"] = out.logits.double().sum().item()  # compared over the ranks: identical
        out = parallel(**batch)  # labels, eval: full logits, the vocab-parallel loss
        result["eval_logits"] = rel_err(out.logits, ref.logits)
        result["eval_loss"] = rel_err(out.loss, ref.loss)
        head = parallel.get_output_embeddings()
        start, end = head.weight.shard_layout.ranges[0]
        with op.logits_mode(parallel, "local"):
            result["local_logits"] = rel_err(parallel(**inputs).logits, ref.logits[..., start:end])
        result["mode_restored"] = head.logits_mode
    out = parallel(**batch)  # a training step (labels, gradients on), even in eval mode: the logits stay local
    result["eval_mode_step_width"] = out.logits.shape[-1]
    parallel.train()
    reference.train()
    out = parallel(**batch)
    result["train_local_width"] = (out.logits.shape[-1], end - start)
    result["train_loss"] = rel_err(out.loss, reference(**batch).loss)
    with op.logits_mode(parallel, "full"):
        result["train_full_logits"] = rel_err(parallel(**batch).logits, reference(**batch).logits)
    parallel.eval()
    reference.eval()
    result["generate"] = _generations(reference, parallel, mesh, inputs)
    return result


def assert_causal(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        for key in ("logits", "eval_logits", "eval_loss", "local_logits", "train_loss", "train_full_logits"):
            assert result[key] <= TOL, f"rank {rank}: {key} relative error {result[key]:.2e}"
        assert result["mode_restored"] == "auto"
        width, local = result["train_local_width"]
        assert width == local, f"rank {rank}: training logits {width} wide, the local vocabulary is {local}"
        assert result["eval_mode_step_width"] == local, f"rank {rank}: an eval-mode training step gathered logits"
        for strategy, (got, want) in result["generate"].items():
            assert got == want, f"rank {rank}: {strategy} generated {got}, the single-device model {want}"
    assert len({r["logits_checksum"] for r in results}) == 1, "the full logits differ between ranks"


LLAMA_CASES = [
    (2, {}, False),
    (4, {"num_key_value_heads": 1, "tie_word_embeddings": True, "vocab_size": 130}, False),  # GQA kv < tp, tied
    (2, {"vocab_size": 131, "tie_word_embeddings": True}, True),  # sequence parallel, uneven vocab
    (4, {}, True),
]


@pytest.mark.parametrize(
    "tp,overrides,sp", LLAMA_CASES, ids=[f"tp{t}-sp{int(sp)}-{i}" for i, (t, _, sp) in enumerate(LLAMA_CASES)]
)
def test_llama_logits_and_generate(pool, tp, overrides, sp):
    assert_causal(pool.run(check_causal, tiny_config("llama", **overrides), tp, sp))


FAMILY_CASES = [
    ("qwen3", 2, {}),
    ("gemma2", 2, {}),
    ("mixtral", 4, {"vocab_size": 130}),
    ("phi3", 4, {"num_key_value_heads": 1}),
    ("gpt2", 2, {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),  # no dropout in training mode
]


@pytest.mark.parametrize("model_type,tp,overrides", FAMILY_CASES, ids=[f"{m}-tp{t}" for m, t, _ in FAMILY_CASES])
def test_family_generate(pool, model_type, tp, overrides):
    config = AutoConfig.for_model(model_type, **{**TOKENS, **FAMILIES[model_type], **overrides})
    assert_causal(pool.run(check_causal, config, tp))


def test_automatic_plan_generate(pool):
    from test_auto_plan import auto_config

    results = pool.run(check_causal, auto_config("olmo2"), 2)
    assert results[0]["parallelizer"] == "AutoPlanParallelizer[olmo2]"
    assert_causal(results)


def check_t5(tp: int) -> dict:
    config = AutoConfig.for_model("t5", **{**TOKENS, **FAMILIES["t5"]})
    mesh, reference, parallel, _ = _parallel_pair(config, tp, "s2s")
    batch = _prompts(config)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        decoder = batch["input_ids"][:, :5]
        got, want = (m(**inputs, decoder_input_ids=decoder).logits for m in (parallel, reference))
        logits = rel_err(got, want)
    return {"logits": logits, "generate": _generations(reference, parallel, mesh, inputs)}


def test_t5_generate(pool):
    for rank, result in enumerate(pool.run(check_t5, 2)):
        assert result["logits"] <= TOL, f"rank {rank}: logits relative error {result['logits']:.2e}"
        for strategy, (got, want) in result["generate"].items():
            assert got == want, f"rank {rank}: {strategy} generated {got}, the single-device model {want}"


def _word_tokenizer(vocab_size: int):
    """A whitespace word-level tokenizer over the ids 0..vocab-1 ("w0" is padding, "w2" the end): no hub needed."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w3"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="w3", pad_token="w0", bos_token="w1", eos_token="w2", padding_side="left"
    )


def check_text_generation_pipeline(tp: int) -> tuple[list, list]:
    from transformers import pipeline

    config = tiny_config("llama", vocab_size=130, pad_token_id=0)
    _, reference, parallel, _ = _parallel_pair(config, tp)
    tokenizer = _word_tokenizer(config.vocab_size)
    prompts = ["w5 w9 w17 w33 w65", "w100 w7 w44"]
    outputs = []
    for model in (parallel, reference):
        generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
        outputs.append(generator(prompts, max_new_tokens=NEW_TOKENS, do_sample=False, batch_size=2))
    return outputs[0], outputs[1]


def test_text_generation_pipeline(pool):
    for rank, (got, want) in enumerate(pool.run(check_text_generation_pipeline, 2)):
        assert got == want, f"rank {rank}: {got} vs the single-device pipeline {want}"
        assert all(len(out[0]["generated_text"].split()) > 3 for out in got)


def check_trainer_predict(tp: int) -> dict:
    """ParallelTrainer.predict (compute_metrics) and evaluate: full-vocabulary predictions, the reference loss."""
    import tempfile

    from optimum_parallel import ParallelTrainer, ParallelTrainingArguments

    config = tiny_config("llama", vocab_size=130)
    reference = build_model(config)
    batch = make_batch(config, batch=4, seq=8)
    rows = [{k: v[i] for k, v in batch.items()} for i in range(4)]
    with torch.no_grad():
        expected = reference(**batch)
    seen = {}

    def metrics(prediction):
        seen["width"] = prediction.predictions.shape[-1]
        predicted = prediction.predictions[:, :-1].argmax(-1)
        return {"accuracy": float((predicted == prediction.label_ids[:, 1:]).mean())}

    with tempfile.TemporaryDirectory() as out:
        args = ParallelTrainingArguments(
            output_dir=out, tensor_parallel_size=tp, per_device_eval_batch_size=2, report_to="none",
            disable_tqdm=True, use_cpu=True, ddp_timeout=60,
        )  # fmt: skip
        trainer = ParallelTrainer(copy.deepcopy(reference), args, compute_metrics=metrics)
        predicted = trainer.predict(rows)
        evaluated = trainer.evaluate(rows)
        trainer.compute_metrics = None
        trainer.args.prediction_loss_only = True  # the logits stay vocab-parallel
        loss_only = trainer.evaluate(rows)
    accuracy = (expected.logits[:, :-1].argmax(-1) == batch["labels"][:, 1:]).float().mean().item()
    return {
        "accuracy": abs(evaluated["eval_accuracy"] - accuracy),
        "logits": rel_err(torch.as_tensor(predicted.predictions), expected.logits),
        "width": seen["width"],
        "loss": abs(predicted.metrics["test_loss"] - expected.loss.item()),
        "loss_only": abs(loss_only["eval_loss"] - expected.loss.item()),
    }


def test_trainer_predict_and_evaluate(pool):
    for rank, result in enumerate(pool.run(check_trainer_predict, 2)):
        assert result["width"] == 130, f"rank {rank}: compute_metrics saw {result['width']} logits per token"
        assert all(result[k] <= TOL for k in ("logits", "accuracy", "loss", "loss_only")), f"rank {rank}: {result}"


def check_pipeline_parallel_generate() -> str:
    import optimum_parallel as op

    op.init_mesh(dp=1, pp=2, tp=2)
    config = tiny_config("llama")
    model = build_model(config)
    model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(
        model, pipeline_parallel_num_microbatches=2
    )
    try:
        model.generate(**{k: v for k, v in _prompts(config).items() if k != "labels"}, **GREEDY)
    except NotImplementedError as err:
        return str(err)
    return "no error"


def test_generate_under_pipeline_parallelism_is_a_clear_error(pool):
    for message in pool.run(check_pipeline_parallel_generate):
        assert "pipeline-parallel" in message and "tensor parallelism only" in message, message


def check_different_prompts_on_tp_ranks() -> str:
    """A tp rank holding other prompts than its peers: one clear error on every rank, no hang, no wrong tokens."""
    import optimum_parallel as op

    mesh = op.init_mesh(dp=dist.get_world_size() // 2, tp=2)
    config = tiny_config("llama")
    model = build_model(config)
    model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(model)
    inputs = {k: v for k, v in _prompts(config).items() if k != "labels"}
    if mesh.rank("tp") == 1:
        inputs["input_ids"] = inputs["input_ids"].flip(-1)
    try:
        model.generate(**inputs, **GREEDY)
    except ValueError as err:
        return str(err)
    return "no error"


def test_different_prompts_on_tp_ranks_is_a_clear_error(pool):
    for message in pool.run(check_different_prompts_on_tp_ranks):
        assert "tp ranks [1] hold other prompts than tp rank 0" in message, message
