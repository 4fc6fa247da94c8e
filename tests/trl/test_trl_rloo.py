"""TRL's RLOOTrainer on a parallel model (gloo, 2 ranks): ParallelRLOOTrainer at tp=2, tp=2 + sp and cp=2 logs, step
by step and in the evaluation after step 3, every figure TRL's RLOOTrainer logs on one process (completions fixed by
the prompt and its place in the batch, as the GRPO tests: 1-8 tokens, prompts of 2-6, so rows carry padding on both
sides), within 1e-5 relative or 10 x the figure's fp32 noise floor (TRL's run from weights perturbed by 1e-7); real
sampling draws the same completions on both ranks of a replica; the options a layout cannot run are refused by name
before anything runs; `examples/rloo.py` runs under torchrun. (dp=2 x tp=2 at level 3: test_trl_rloo_dp.py; pp=2 and
pp=2 x tp=2, and pp with cp refused: test_trl_rloo_pp.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

from _dpo import check_against, noise_floor, perturbed_copy  # noqa: E402
from _grpo import grpo_args, prompts, save_tiny_llama  # noqa: E402
from _rloo import train_parallel, trl_reference  # noqa: E402

WORLD_SIZE = 2
TOL = 1e-5
ROOT = Path(__file__).resolve().parent.parent.parent
# two iterations per generation: the second step's policy has moved from the one that scored the completions, so the
# clip ratios are not all 0
OPTIONS = {"num_iterations": 2, "epsilon": 0.05}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return save_tiny_llama(str(tmp_path_factory.mktemp("hf") / "llama"))


@pytest.fixture(scope="module")
def reference(hf_dir, tmp_path_factory) -> tuple[dict, dict]:
    """TRL's RLOOTrainer on one process: every figure per step, and each figure's fp32 noise floor."""
    expected = trl_reference(hf_dir, str(tmp_path_factory.mktemp("ref")), **OPTIONS)
    perturbed = perturbed_copy(hf_dir, tmp_path_factory.mktemp("perturbed"))
    moved = trl_reference(perturbed, str(tmp_path_factory.mktemp("ref")), **OPTIONS)
    return expected, noise_floor(expected, moved)


LAYOUTS = {
    "tp2": {"tensor_parallel_size": 2},
    # every length even, so sp splits every forward (it splits lengths tp divides)
    "tp2-sp": {"tensor_parallel_size": 2, "sequence_parallel": True, "pad_to_multiple_of": 2},
    "cp2": {"context_parallel_size": 2},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rloo_matches_trl_on_one_process(pool, hf_dir, reference, tmp_path, layout):
    expected, noise = reference
    assert sorted(expected) == [1, 2, 3] and expected[3]["kl"] != 0 and "eval_loss" in expected[3]
    assert expected[2]["clip_ratio/region_mean"] > 0, expected[2]
    results = pool.run(train_parallel, hf_dir, str(tmp_path / "parallel"), **OPTIONS, **LAYOUTS[layout])
    for rank, result in enumerate(results):
        worst = check_against(result["every"], expected, noise, TOL)
        if rank == 0:
            print(f"\n{layout} worst relative error:", {k: f"{v:.1e}" for k, v in sorted(worst.items()) if v})
            print("fp32 noise floor:", {k: f"{v:.1e}" for k, v in sorted(noise.items()) if v})


def test_sampling_is_identical_on_the_ranks_of_a_replica(pool, hf_dir, tmp_path):
    """Real sampling (the parallel model's generate, temperature 1) at tp=2: both ranks log the same completions."""
    results = pool.run(train_parallel, hf_dir, str(tmp_path), fixed=False, max_steps=2, **LAYOUTS["tp2"])
    assert results[0]["completions"] and results[0]["completions"] == results[1]["completions"]
    assert results[0]["every"] == results[1]["every"]


def refused(hf_dir: str, output_dir: str, options: dict) -> str:
    from _grpo import even_tokens
    from transformers import AutoTokenizer

    from optimum_parallel.integrations.trl import ParallelRLOOConfig, ParallelRLOOTrainer

    try:
        args = ParallelRLOOConfig(**grpo_args(output_dir, eval_strategy="no", **options))
        ParallelRLOOTrainer(hf_dir, reward_funcs=even_tokens, args=args, train_dataset=prompts(),
                            processing_class=AutoTokenizer.from_pretrained(hf_dir))  # fmt: skip
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(
    "options,words",
    [
        ({"tensor_parallel_size": 2, "use_liger_kernel": True}, "use_liger_kernel=True"),
        ({"sync_ref_model": True, "sharding_level": 3}, "sync_ref_model=True is not supported with sharding_level=3"),
        ({"tensor_parallel_size": 2, "per_device_train_batch_size": 2}, "generation_batch_size (2) must be divisible"),
    ],
    ids=["liger", "sync_ref_fsdp2", "generation_batch"],
)
def test_what_a_layout_cannot_run_is_refused_by_name(pool, hf_dir, tmp_path, options, words):
    for message in pool.run(refused, hf_dir, str(tmp_path), options):
        assert words in message, message
        assert "allowed" in message or "divisible" in message, message


def test_example_runs_under_torchrun(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    example = str(ROOT / "examples" / "rloo.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", example,
               "--output-dir", str(tmp_path), "--steps", "4"]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "mean reward" in done.stdout, done.stdout[-3000:]
