"""Sampling that does not depend on the layout: with TRL's real generation (temperature 1, no fixed completions),
ParallelGRPOTrainer at tp=2, tp=2 + sp, cp=2, pp=2 and pp=2 x tp=2 draws, token by token, the completions TRL's
GRPOTrainer draws on one process at the same seed, and so logs every figure TRL logs; at dp=2 x tp=2 each replica draws
what TRL's process of the same index draws on 2 processes. The tiny model's next-token distributions are close to
uniform (entropy ~4.8 nats over 128 tokens), so an fp32 reduction order moving a probability by ~1e-7 flips a draw
only if the draw lands that close to a boundary: at this seed none does (a flip would fail here, not be tolerated).

What made the draws differ before: the split regions of a tp layer (tensor_parallel/random.py) drew a seed from the
shared default stream at every training-mode forward, and TRL generates with the model in training mode, so every
generated token moved the stream that `multinomial` then read."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from _dpo import check_against, noise_floor, perturbed_copy  # noqa: E402
from _grpo import save_tiny_llama, train_parallel, trl_reference  # noqa: E402
from _pool import WorkerPool  # noqa: E402

WORLD_SIZE = 2
TOL = 1e-5  # relative (|value| below 1e-3 counts as 1e-3), or 10 x the figure's fp32 noise floor where larger
# two optimizer steps per generation: TRL shuffles the generation batch with the default generator between them, so
# the micro-batches are cut as on one process only if nothing else moved that stream
SHUFFLED = {"steps_per_generation": 2, "per_device_train_batch_size": 6, "per_device_eval_batch_size": 12}
LAYOUTS = {  # (the parallel layout, TRL's options)
    "tp2": ({"tensor_parallel_size": 2}, {}),
    "tp2-sp": ({"tensor_parallel_size": 2, "sequence_parallel": True, "pad_to_multiple_of": 2}, {}),
    "cp2": ({"context_parallel_size": 2}, {}),
    "pp2": ({"pipeline_parallel_size": 2}, {}),  # generation through the stages, a token at a time, no kv cache
    "tp2-shuffled": ({"tensor_parallel_size": 2}, SHUFFLED),
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return save_tiny_llama(str(tmp_path_factory.mktemp("hf") / "llama"))


def leave_out(figures: dict, names: tuple[str, ...]) -> dict:
    return {step: {k: v for k, v in values.items() if k not in names} for step, values in figures.items()}


def reference_and_floor(run, hf_dir: str, directory, **options) -> tuple[list, dict]:
    """TRL's runs (`run(trl_reference, ...)`: one per process) from the weights and from the weights moved by 1e-7
    relative, which must draw the same completions (so the difference is fp32 rounding, not other samples): the
    runs from the weights and the noise floor of every figure (of the first process)."""
    expected = run(trl_reference, hf_dir, str(directory / "reference"), fixed=False, **options)
    moved = run(trl_reference, perturbed_copy(hf_dir, directory / "moved"), str(directory / "moved_run"), fixed=False,
                **options)  # fmt: skip
    assert [m["drawn"] for m in moved] == [e["drawn"] for e in expected]
    return expected, noise_floor(expected[0]["every"], moved[0]["every"])


@pytest.fixture(scope="module")
def one_process(hf_dir, tmp_path_factory):
    """TRL on this process with `options`, and its noise floor: run once per module for each set of options."""
    done: dict[str, tuple[dict, dict]] = {}

    def run(options: dict) -> tuple[dict, dict]:
        key = repr(sorted(options.items()))
        if key not in done:
            here = lambda fn, *a, **k: [fn(*a, **k)]  # noqa: E731 - run on this process, as the pools' run
            expected, noise = reference_and_floor(here, hf_dir, tmp_path_factory.mktemp("trl"), **options)
            done[key] = expected[0], noise
        return done[key]

    return run


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_replica_draws_what_trl_draws_on_one_process(pool, hf_dir, one_process, tmp_path, layout):
    """Every rank draws TRL's completions token by token; every figure within 1e-5 relative or 10 x its noise floor."""
    parallel, options = LAYOUTS[layout]
    expected, noise = one_process(options)
    generations = -(-3 // options.get("steps_per_generation", 1))  # 3 steps
    assert len(expected["drawn"]) == generations + 2  # the training generations, 2 evaluation batches after step 3
    assert sorted(expected["every"]) == [1, 2, 3] and "eval_loss" in expected["every"][3]
    results = pool.run(train_parallel, hf_dir, str(tmp_path), fixed=False, **parallel, **options)
    for rank, result in enumerate(results):
        assert result["drawn"] == expected["drawn"], (rank, layout)  # token by token, every generation
        worst = check_against(result["every"], expected["every"], noise, TOL)
        if rank == 0:
            print(f"\n{layout}: worst relative error per figure", {k: f"{v:.1e}" for k, v in worst.items() if v})
            print("fp32 noise floor:", {k: f"{v:.1e}" for k, v in noise.items() if v})


@pytest.fixture(scope="module")
def pool4():
    workers = WorkerPool(4)
    yield workers
    workers.close()


def test_pp2_tp2_draws_what_trl_draws_on_one_process(pool4, hf_dir, one_process, tmp_path):
    """pp x tp: the pipeline's generation samples from the whole vocabulary, its scoring reads each tp rank's slice."""
    expected, noise = one_process({})
    results = pool4.run(train_parallel, hf_dir, str(tmp_path), fixed=False, pipeline_parallel_size=2,
                        tensor_parallel_size=2)  # fmt: skip
    for rank, result in enumerate(results):
        assert result["drawn"] == expected["drawn"], rank  # token by token, every generation
        worst = check_against(result["every"], expected["every"], noise, TOL)
        if rank == 0:
            print("\npp2 x tp2: worst relative error per figure", {k: f"{v:.1e}" for k, v in worst.items() if v})


# TRL on 2 processes weighs its evaluation loss by accelerate's `gather_for_metrics`, which keeps the first
# len(eval prompts) % global batch losses of the last batch: one process's share there. ParallelGRPOTrainer logs the
# whole batch's (TRL's one-process figure; test_trl_grpo_dp checks it), so that one figure is left out here.
DP_ONLY = ("eval_loss",)


def test_dp2_tp2_draws_what_trl_draws_on_two_processes(pool, pool4, hf_dir, tmp_path):
    """Each replica draws its TRL process's completions token by token; every figure (but the evaluation loss, see
    DP_ONLY) within 1e-5 relative or 10 x its noise floor (FSDP2's grad norm of step 3: ~1e-5 relative)."""
    per_process = {"per_device_train_batch_size": 6}
    expected, noise = reference_and_floor(pool.run, hf_dir, tmp_path, **per_process)
    assert expected[0]["drawn"] != expected[1]["drawn"]  # each process its own prompts and seed
    results = pool4.run(train_parallel, hf_dir, str(tmp_path / "parallel"), fixed=False, tensor_parallel_size=2,
                        sharding_level=3, **per_process)  # fmt: skip
    assert sorted(r["replica"] for r in results) == [0, 0, 1, 1]
    for rank, result in enumerate(results):
        twin = expected[result["replica"]]
        assert result["drawn"] == twin["drawn"], (rank, result["replica"])  # token by token, every generation
        worst = check_against(leave_out(result["every"], DP_ONLY), leave_out(twin["every"], DP_ONLY), noise, TOL)
        if rank == 0:
            print("\ndp2 x tp2: worst relative error per figure", {k: f"{v:.1e}" for k, v in worst.items() if v})
            print("fp32 noise floor:", {k: f"{v:.1e}" for k, v in noise.items() if v})
