"""Defaults that run: ParallelSFTConfig and ParallelDPOConfig with only `pipeline_parallel_size=2` set train, and
`gradient_accumulation_steps=2` under pp is folded into the schedule's micro-batches; each logs, step by step, the
losses (and DPO's metrics) TRL's trainer logs on one process with the same arguments (gloo, 2 ranks)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from _dpo import check_against, noise_floor, perturbed_copy, save_tiny, train_parallel_dpo, trl_reference  # noqa: E402

WORLD_SIZE = 2
TOL = 1e-6  # SFT: relative, per step (fp32 noise is ~1e-7 here); DPO: `_dpo.check_against`'s 1e-5 or 10 x noise
DPO_TOL = 1e-5
PP2 = {"pipeline_parallel_size": 2}  # nothing else: the micro-batches are the arguments' default


@pytest.mark.parametrize(
    "given,expected",
    [
        ({}, (8, 8, 1)),  # TRL's per-device batch 8: a micro-batch per sample
        ({"per_device_train_batch_size": 4}, (4, 4, 1)),  # eval 8: 4 micro-batches cut both
        ({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}, (4, 4, 1)),
        ({"per_device_train_batch_size": 4, "pipeline_parallel_num_microbatches": 2, "gradient_accumulation_steps": 2},
         (8, 4, 1)),
        ({"per_device_train_batch_size": 1, "per_device_eval_batch_size": 2, "gradient_accumulation_steps": 2},
         (2, 2, 1)),
    ],
)  # fmt: skip
def test_pipeline_defaults_and_folded_accumulation(tmp_path, given, expected):
    """(per-device train batch, micro-batches, accumulation steps) the arguments end with under pp=2."""
    from optimum_parallel.integrations.trl import ParallelDPOConfig, ParallelSFTConfig

    for config in (ParallelSFTConfig, ParallelDPOConfig):
        args = config(output_dir=str(tmp_path), use_cpu=True, report_to="none", **PP2, **given)
        got = (args.per_device_train_batch_size, args.pipeline_parallel_num_microbatches)
        assert (*got, args.gradient_accumulation_steps) == expected, (config.__name__, given)


def test_a_batch_too_small_for_the_pipeline_is_refused_by_name(tmp_path):
    from optimum_parallel.integrations.trl import ParallelSFTConfig

    with pytest.raises(ValueError, match="pipeline_parallel_size=2 needs at least 2 micro-batches"):
        ParallelSFTConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=1, **PP2)


# ------------------------------------------------------------------ SFT against TRL's SFTTrainer on one process


@pytest.fixture(scope="module")
def sft_hf_dir(tmp_path_factory) -> str:
    from _models import build_model, tiny_config
    from test_trl import make_tokenizer

    path = tmp_path_factory.mktemp("hf") / "llama"
    config = tiny_config("llama", pad_token_id=0, eos_token_id=2)
    build_model(config, seed=3).save_pretrained(path)
    make_tokenizer(config.vocab_size).save_pretrained(path)
    return str(path)


def sft_reference(hf_dir: str, output_dir: str, **options) -> dict[int, float]:
    """TRL's SFTTrainer on one process (packed rows, each document attending to itself only): its losses per step."""
    import torch
    from test_trl import dataset, document_attention, losses, sft_args
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    AttentionInterface.register("documents", document_attention)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="documents")
    args = SFTConfig(**sft_args(output_dir, **options))
    trainer = SFTTrainer(
        model,
        args,
        train_dataset=dataset(model.config.vocab_size),
        processing_class=AutoTokenizer.from_pretrained(hf_dir),
    )
    trainer.train()
    return losses(trainer.state.log_history)


def sft_parallel(hf_dir: str, output_dir: str, options: dict) -> dict:
    from test_trl import train_sft

    return train_sft(hf_dir, output_dir, **options, **PP2)["losses"]


@pytest.mark.parametrize(
    "options",
    [{}, {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 2}],
    ids=["pp2-only", "pp2-accumulate2"],
)
def test_sft_with_only_pp_set_matches_trl(pool, sft_hf_dir, tmp_path, options):
    expected = sft_reference(sft_hf_dir, str(tmp_path / "ref"), **options)
    for rank, got in enumerate(pool.run(sft_parallel, sft_hf_dir, str(tmp_path / "pp"), options)):
        assert sorted(got) == sorted(expected), (rank, got, expected)
        worst = max(abs(got[s] - expected[s]) / abs(expected[s]) for s in expected)
        print(options, rank, f"worst relative loss error {worst:.1e}")
        assert worst <= TOL, (rank, got, expected)


# ------------------------------------------------------------------ DPO against TRL's DPOTrainer on one process


@pytest.fixture(scope="module")
def dpo_hf_dirs(tmp_path_factory) -> tuple[str, str]:
    """A tiny Llama and the same weights perturbed by relative 1e-7 (TRL's run from it: the fp32 noise floor)."""
    path = save_tiny(tmp_path_factory.mktemp("hf") / "llama", "llama")
    return path, perturbed_copy(path, tmp_path_factory.mktemp("perturbed") / "llama")


ACCUMULATE = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}
WHOLE_BATCH = {"per_device_train_batch_size": 4}  # the step's batch as one, as the fold runs it
PER_PAIR = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
            "logps/rejected", "num_tokens")  # fmt: skip


def _dpo_reference(hf_dirs: tuple[str, str], output_dir, options: dict) -> tuple[dict, dict]:
    hf_dir, perturbed = hf_dirs
    expected = trl_reference(hf_dir, str(output_dir / "ref"), **options)
    return expected, noise_floor(expected, trl_reference(perturbed, str(output_dir / "moved"), **options))


def _only(metrics: dict, keys) -> dict:
    return {step: {k: v for k, v in values.items() if k in keys} for step, values in metrics.items()}


def test_dpo_with_only_pp_set_matches_trl(pool, dpo_hf_dirs, tmp_path):
    expected, noise = _dpo_reference(dpo_hf_dirs, tmp_path, {})
    for rank, got in enumerate(pool.run(train_parallel_dpo, dpo_hf_dirs[0], str(tmp_path / "pp"), {}, PP2)):
        worst = check_against(got, expected, noise, DPO_TOL)
        print("pp2", rank, {k: f"{v:.1e}" for k, v in worst.items()})


def test_dpo_accumulation_under_pp_is_the_whole_batch_step(pool, dpo_hf_dirs, tmp_path):
    """gradient_accumulation_steps=2 folded into the schedule: every metric of TRL's step on the whole batch (its
    per-device batch 4, no accumulation), and the loss, rewards and log-probabilities of TRL with accumulation (its
    logits means, entropy and token accuracy average the two halves' means instead: token-weighted, they differ)."""
    got = pool.run(train_parallel_dpo, dpo_hf_dirs[0], str(tmp_path / "pp"), ACCUMULATE, PP2)
    whole, whole_noise = _dpo_reference(dpo_hf_dirs, tmp_path / "whole", WHOLE_BATCH)
    accumulated, accumulated_noise = _dpo_reference(dpo_hf_dirs, tmp_path / "accumulated", ACCUMULATE)
    for rank, metrics in enumerate(got):
        worst = check_against(metrics, whole, whole_noise, DPO_TOL)
        print("pp2 accumulate2 vs whole batch", rank, {k: f"{v:.1e}" for k, v in worst.items()})
        worst = check_against(_only(metrics, PER_PAIR), _only(accumulated, PER_PAIR), accumulated_noise, DPO_TOL)
        print("pp2 accumulate2 vs accumulated", rank, {k: f"{v:.1e}" for k, v in worst.items()})
