"""TRL's GRPOTrainer on a parallel model (gloo, 2 ranks): ParallelGRPOTrainer at tp=2 (with and without sequence
parallelism) logs, step by step, the loss, kl, reward and entropy TRL's GRPOTrainer logs on one process (completions
fixed by the prompt and its place in the batch, so sampling is the same whatever the layout), and at cp=2 (a Llama and
a Qwen3.5 hybrid) every figure it logs; with real sampling both ranks of the replica draw the same completions, and
generation under cp (without a kv cache) is the whole model's; a reward function returning the wrong count raises
TRL's error on every rank before any step; the layouts and options it cannot run are refused by name;
`examples/grpo.py` runs under torchrun. (dp=2 x tp=2 on 4 ranks: test_trl_grpo_dp.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

from _dpo import check_against, noise_floor, perturbed_copy  # noqa: E402
from _grpo import (  # noqa: E402
    grpo_args,
    print_table,
    prompts,
    save_tiny,
    save_tiny_llama,
    train_parallel,
    trl_reference,
    worst_errors,
)
from transformers import BitsAndBytesConfig, ProcessorMixin  # noqa: E402

WORLD_SIZE = 2
CP2 = {"context_parallel_size": 2}
TOL = 1e-5  # relative, per step and metric (fp32; seen: up to 3.5e-6, the LoRA run's kl of ~1e-3)
ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return save_tiny_llama(str(tmp_path_factory.mktemp("hf") / "llama"))


@pytest.fixture(scope="module")
def reference(hf_dir, tmp_path_factory) -> dict:
    return trl_reference(hf_dir, str(tmp_path_factory.mktemp("reference")))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_tp2_matches_trl_on_one_process(pool, hf_dir, reference, tmp_path, sequence_parallel):
    layout = {"tensor_parallel_size": 2, "sequence_parallel": sequence_parallel}
    if sequence_parallel:  # every length even, so sp splits every forward (it splits lengths tp divides)
        layout["pad_to_multiple_of"] = 2
    results = pool.run(train_parallel, hf_dir, str(tmp_path), **layout)
    assert sorted(reference) == [1, 2, 3] and reference[1]["kl"] == 0.0 and reference[2]["kl"] > 0
    assert {"eval_loss", "eval_kl", "eval_reward"} <= set(reference[3])  # an evaluation after step 3
    for rank, result in enumerate(results):
        got = result["logged"]
        assert sorted(got) == sorted(reference), (rank, got)
        worst = worst_errors(got, reference)
        if rank == 0:
            print_table("tp=2" + (" + sp" if sequence_parallel else ""), got, reference)
        assert max(worst.values()) <= TOL, (rank, worst, got, reference)


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"context_parallel_size": 2}], ids=["tp2", "cp2"])
def test_lora_matches_trl_on_one_process(pool, hf_dir, tmp_path, layout):
    """LoRA adapters (`peft_config`) with beta > 0: TRL's reference is the policy without its fresh adapters."""
    expected = trl_reference(hf_dir, str(tmp_path / "reference"), peft=True)
    results = pool.run(train_parallel, hf_dir, str(tmp_path / "parallel"), peft=True, **layout)
    assert expected[2]["kl"] > 0
    for rank, result in enumerate(results):
        got = result["logged"]
        worst = worst_errors(got, expected)
        if rank == 0:
            print_table(f"{layout} LoRA", got, expected)
        assert max(worst.values()) <= TOL, (rank, worst, got, expected)


SYNC = {"sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.5}


def test_sync_ref_model_at_tp2_matches_trl_on_one_process(pool, hf_dir, tmp_path):
    """TRL's callback mixes the policy into the reference after every step: both parallel, shard by shard."""
    expected = trl_reference(hf_dir, str(tmp_path / "reference"), **SYNC)
    results = pool.run(train_parallel, hf_dir, str(tmp_path / "parallel"), tensor_parallel_size=2, **SYNC)
    for rank, result in enumerate(results):
        worst = worst_errors(result["logged"], expected)
        assert max(worst.values()) <= TOL, (rank, worst, result["logged"], expected)


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, CP2], ids=["tp2", "cp2"])
def test_sampling_is_identical_on_the_ranks_of_a_replica(pool, hf_dir, tmp_path, layout):
    """Real sampling (the parallel model's generate, temperature 1; under cp without a kv cache): both ranks of the
    replica log the same completions."""
    results = pool.run(train_parallel, hf_dir, str(tmp_path), fixed=False, max_steps=2, **layout)
    assert results[0]["completions"] and results[0]["completions"] == results[1]["completions"]
    assert results[0]["logged"] == results[1]["logged"]


# two iterations per generation: the second step's policy has moved from the one that scored the completions, so
# its clip ratios are not 0
CLIPPING = {"num_iterations": 2, "epsilon": 0.05}


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5_text"])
def test_cp2_matches_trl_on_one_process(pool, tmp_path, model_type):
    """Each cp rank runs its chunks of every row (a hybrid's gated delta net the whole rows, its heads split over
    cp); the per-token log-probs and entropies, gathered over cp, give TRL's loss, and its gradient, averaged over
    the dp x cp ranks, the one-process step: every figure TRL logs, step by step and in the evaluation after step 3,
    within 1e-5 relative or 10 x its fp32 noise floor (the hybrid's eval loss, a near-cancelling 1.6e-3, moves by
    2e-3 relative when the weights move by 1e-7)."""
    hf_dir = save_tiny(str(tmp_path / model_type), model_type)
    expected = trl_reference(hf_dir, str(tmp_path / "reference"), every=True, **CLIPPING)
    assert sorted(expected) == [1, 2, 3] and expected[2]["kl"] > 0 and expected[2]["clip_ratio/region_mean"] > 0
    assert {"eval_loss", "eval_kl", "eval_reward", "eval_entropy", "grad_norm"} <= set(expected[3]) | set(expected[2])
    moved = trl_reference(
        perturbed_copy(hf_dir, tmp_path / "perturbed"), str(tmp_path / "ref2"), every=True, **CLIPPING
    )
    noise = noise_floor(expected, moved)
    results = pool.run(train_parallel, hf_dir, str(tmp_path / "parallel"), **CP2, **CLIPPING)
    for rank, result in enumerate(results):
        got = result["every"]
        if rank == 0:
            print_table(f"{model_type} cp=2", got, expected)
            print("fp32 noise floor:", {k: f"{v:.1e}" for k, v in noise.items() if v})
        check_against(got, expected, noise, TOL)


def generate_at_cp2(hf_dir: str) -> tuple[list, list, list]:
    """Greedy completions of left-padded prompts: through the cp=2 model's cache-free generation (GRPO's under cp)
    and through the whole model on this process; then two samples drawn under one seed per rank."""
    import torch
    from transformers import AutoModelForCausalLM

    import optimum_parallel as op
    from optimum_parallel.integrations.trl.grpo import _generate_without_cache

    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    mesh = op.init_mesh(cp=2)
    model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(model)
    ids = torch.randint(3, 128, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = mask[1, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    settings = {"max_new_tokens": 6, "pad_token_id": 0, "eos_token_id": 2}
    with torch.no_grad():
        expected = reference.generate(input_ids=ids, attention_mask=mask, do_sample=False, **settings)
        with _generate_without_cache(model, mesh):
            got = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **settings)
            torch.manual_seed(op.get_mesh().rank("cp"))  # other seeds: the ranks must still draw alike
            sampled = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, **settings)
    return got.tolist(), expected.tolist(), sampled.tolist()


def test_generation_under_cp2_is_the_whole_models(pool, tmp_path):
    """Under cp the model keeps no kv cache: GRPO generates without one, each new token from the whole rows run over
    the cp ranks (a hybrid's delta net included); greedy, that is the whole model's `generate`, and sampling draws
    the same tokens on both cp ranks."""
    for model_type in ("llama", "qwen3_5_text"):
        hf_dir = save_tiny(str(tmp_path / model_type), model_type)
        results = pool.run(generate_at_cp2, hf_dir)
        for got, expected, _ in results:
            assert got == expected, (model_type, got, expected)
        assert results[0][2] == results[1][2], model_type


def wrong_count(completions, **kwargs) -> list[float]:
    return [0.0] * (len(completions) - 1)


def bad_reward(hf_dir: str, output_dir: str) -> dict:
    from transformers import AutoTokenizer

    from optimum_parallel.integrations.trl import ParallelGRPOConfig, ParallelGRPOTrainer

    args = ParallelGRPOConfig(**grpo_args(output_dir, tensor_parallel_size=2, eval_strategy="no"))
    trainer = ParallelGRPOTrainer(
        hf_dir, reward_funcs=wrong_count, args=args, train_dataset=prompts(),
        processing_class=AutoTokenizer.from_pretrained(hf_dir),
    )  # fmt: skip
    before = [p.detach().clone() for p in trainer.model.parameters()]
    try:
        trainer.train()
    except ValueError as err:
        unchanged = all((a == p.detach()).all() for a, p in zip(before, trainer.model.parameters(), strict=True))
        return {"error": str(err), "step": trainer.state.global_step, "unchanged": unchanged}
    return {"error": None}


def test_a_reward_function_returning_the_wrong_count_raises_trls_error_on_every_rank(pool, hf_dir, tmp_path):
    for result in pool.run(bad_reward, hf_dir, str(tmp_path)):
        assert result["error"] and "'wrong_count' returned 11 rewards, but 12 were expected" in result["error"]
        assert result["step"] == 0 and result["unchanged"], result


def refused(hf_dir: str, output_dir: str, options: dict) -> str:
    from _grpo import even_tokens
    from transformers import AutoTokenizer

    from optimum_parallel.integrations.trl import ParallelGRPOConfig, ParallelGRPOTrainer

    extra = {k: options.pop(k) for k in ("processing_class", "quantization_config", "model_kwargs") if k in options}
    extra.setdefault("processing_class", AutoTokenizer.from_pretrained(hf_dir))
    try:
        args = ParallelGRPOConfig(**grpo_args(output_dir, eval_strategy="no", **options))
        ParallelGRPOTrainer(hf_dir, reward_funcs=even_tokens, args=args, train_dataset=prompts(), **extra)
    except ValueError as err:
        return str(err)
    return "no error"


class ImageProcessor(ProcessorMixin):
    """A multimodal processor as far as the refusal looks (it must come before any generation)."""

    def __init__(self) -> None:
        pass


@pytest.mark.parametrize(
    "options,words",
    [
        ({"pipeline_parallel_size": 2, "context_parallel_size": 2}, "pipeline_parallel_size=2 with context_parallel"),
        ({"tensor_parallel_size": 2, "entropy_coef": 0.01}, "entropy_coef=0.01"),
        ({"tensor_parallel_size": 2, "cast_lm_head_to_fp32": True}, "cast_lm_head_to_fp32=True"),
        ({"tensor_parallel_size": 2, "quantization_config": BitsAndBytesConfig(load_in_4bit=True)},
         "quantization_config is not supported"),
        ({"model_init_kwargs": {"quantization_config": {"load_in_4bit": True}}},
         "quantization_config is not supported"),
        ({"model_init_kwargs": {"dtype": "int8"}}, "model_init_kwargs['dtype']='int8'"),
        ({"model_init_kwargs": {"dtype": "float32"}, "model_kwargs": {}}, "model_kwargs and args.model_init_kwargs"),
        ({"tensor_parallel_size": 2, "per_device_train_batch_size": 2}, "generation_batch_size (2) must be divisible"),
        ({"sync_ref_model": True, "sharding_level": 3}, "sync_ref_model=True is not supported with sharding_level=3"),
        ({"tensor_parallel_size": 2, "processing_class": ImageProcessor()}, "processing_class=ImageProcessor"),
    ],
    ids=["pp_cp", "entropy_coef", "cast_lm_head_to_fp32", "quantization_config", "quantization_in_init_kwargs",
         "init_kwargs_dtype", "model_kwargs_twice", "generation_batch", "sync_ref", "multimodal"],
)  # fmt: skip
def test_what_a_layout_cannot_run_is_refused_by_name(pool, hf_dir, tmp_path, options, words):
    for message in pool.run(refused, hf_dir, str(tmp_path), options):
        assert words in message, message
        assert "allowed" in message or "divisible" in message, message


def test_a_generation_batch_valid_per_replica_is_taken(pool, hf_dir, tmp_path):
    """generation_batch_size=12 at tp=2 (one replica of 12 prompts a step): TRL's own sizing, over 2 processes,
    would refuse it as not divisible by 24."""
    options = {"tensor_parallel_size": 2, "generation_batch_size": 12}
    for message in pool.run(refused, hf_dir, str(tmp_path), options):
        assert message == "no error", message


def test_example_runs_under_torchrun(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    example = str(ROOT / "examples" / "grpo.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", example,
               "--output-dir", str(tmp_path), "--steps", "4"]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "mean reward" in done.stdout, done.stdout[-3000:]
