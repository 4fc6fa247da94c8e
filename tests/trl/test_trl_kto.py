"""TRL's KTOTrainer on a parallel model (gloo, 2 ranks): ParallelKTOTrainer at tp=2, tp=2 + sp, cp=2 and pp=2 logs,
step by step, the loss, kl, rewards, log-probabilities, logits, entropy, token count and gradient norm TRL's
KTOTrainer logs on one process (unpaired rows of several lengths, prompts masked out; `kto` and `apo_zero_unpaired`;
the reference loaded in parallel or precomputed), within 1e-5 relative or 10 x the fp32 noise floor (TRL's run from
weights perturbed by 1e-7); the options a layout cannot run are refused by name before anything runs. (dp=2 x tp=2 at
level 3: test_trl_kto_dp.py.)"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from _dpo import check_against, noise_floor, perturbed_copy, save_tiny  # noqa: E402
from _kto import train_parallel_kto, trl_reference  # noqa: E402

WORLD_SIZE = 2
TOL = 1e-5
OPTIONS = {"optim": "adamw_torch", "learning_rate": 1e-2}  # the policy moves enough for kl > 0 at step 3

TP2 = {"tensor_parallel_size": 2}
# every length even, so sp splits every forward (it splits lengths tp divides)
SP = {"tensor_parallel_size": 2, "sequence_parallel": True, "pad_to_multiple_of": 2}
CP2 = {"context_parallel_size": 2}
PP2 = {"pipeline_parallel_size": 2}

CASES = {
    "tp2": ({}, TP2),
    "sp": ({}, SP),
    "cp2": ({}, CP2),
    "pp2": ({}, PP2),
    "cp2-apo_zero_unpaired": ({"loss_type": "apo_zero_unpaired"}, CP2),
    "tp2-precomputed-reference": ({"precompute_ref_log_probs": True}, TP2),
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return save_tiny(tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture(scope="module")
def reference(hf_dir, tmp_path_factory):
    """TRL's KTOTrainer on one process, each option set trained once: its metrics per step and their noise floor."""
    perturbed = perturbed_copy(hf_dir, tmp_path_factory.mktemp("perturbed") / "llama")
    done: dict[str, tuple] = {}

    def run(**options) -> tuple[dict, dict]:
        key = repr(sorted(options.items()))
        if key not in done:
            expected = trl_reference(hf_dir, str(tmp_path_factory.mktemp("ref")), **OPTIONS, **options)
            moved = trl_reference(perturbed, str(tmp_path_factory.mktemp("ref")), **OPTIONS, **options)
            done[key] = expected, noise_floor(expected, moved)
        return done[key]

    return run


@pytest.mark.parametrize("case", list(CASES))
def test_kto_matches_trl_on_one_process(pool, hf_dir, reference, tmp_path, case):
    options, layout = CASES[case]
    expected, noise = reference(**options)
    assert sorted(expected) == [1, 2, 3] and {"rewards/chosen", "rewards/rejected"} <= set(expected[2])
    if options.get("loss_type") != "apo_zero_unpaired":
        assert expected[3]["kl"] > 0, expected[3]
    for rank, got in enumerate(pool.run(train_parallel_kto, hf_dir, str(tmp_path), {**OPTIONS, **options}, layout)):
        worst = check_against(got, expected, noise, TOL)
        if rank == 0:
            print(f"\n{case} worst relative error:", {k: f"{v:.1e}" for k, v in sorted(worst.items()) if v})
            print("fp32 noise floor:", {k: f"{v:.1e}" for k, v in sorted(noise.items()) if v})


def refused(hf_dir: str, output_dir: str, options: dict) -> str:
    from _dpo import dpo_args
    from _kto import unpaired_dataset
    from transformers import AutoTokenizer

    from optimum_parallel.integrations.trl import ParallelKTOConfig, ParallelKTOTrainer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    try:
        args = ParallelKTOConfig(**dpo_args(output_dir, **options))
        ParallelKTOTrainer(hf_dir, args=args, train_dataset=unpaired_dataset(tokenizer.vocab_size),
                           processing_class=tokenizer)  # fmt: skip
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(
    "options,words",
    [
        ({**PP2, **CP2, "per_device_train_batch_size": 4}, "pipeline_parallel_size=2 with context_parallel_size=2"),
        ({**TP2, "sync_ref_model": True}, "sync_ref_model=True"),
        ({**TP2, "use_liger_kernel": True}, "use_liger_kernel=True"),
    ],
    ids=["pp-with-cp", "sync_ref_model", "liger"],
)
def test_options_a_layout_cannot_run_are_refused_by_name(pool, hf_dir, tmp_path, options, words):
    for message in pool.run(refused, hf_dir, str(tmp_path), options):
        assert words in message and "allowed" in message, message
