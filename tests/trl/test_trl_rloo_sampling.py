"""Sampling that does not depend on the layout, for RLOO: with TRL's real generation (temperature 1, no fixed
completions), ParallelRLOOTrainer at tp=2 and tp=2 + sp (2 ranks) draws, token by token, the completions TRL's
RLOOTrainer draws on one process at the same seed, and logs every figure TRL logs (loss, grad norm, kl, rewards and
their std, entropy, clip ratios, lengths, ...; the evaluation's after step 3) within 1e-5 relative or 10 x the
figure's fp32 noise floor (TRL's run from weights perturbed by 1e-7 relative, which must draw the same completions);
at dp=2 x tp=2 (4 ranks, FSDP2) each replica draws what TRL's process of the same index draws on 2 processes, and logs
what TRL logs there. Prompts of 2-6 tokens are left-padded; completions of 1-8 tokens, some cut at the length limit
(no EOS), right-padded; two iterations per generation, so the second step's policy has moved from the one that scored
the completions (`old_logps`) and some of its sequences are clipped. (pp=2 and pp=2 x tp=2: test_trl_rloo_pp.py.)

The losses of a step that generated and of the evaluation are 0 in exact arithmetic (every ratio is 1, and the
leave-one-out advantages of a group sum to 0): what is logged is an fp32 residual, compared with the advantages'
scale (the reward std) instead of itself (`zero_sums`)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from _dpo import check_against, noise_floor, perturbed_copy  # noqa: E402
from _grpo import COMPLETION_LENGTH, EOS, save_tiny_llama  # noqa: E402
from _pool import WorkerPool  # noqa: E402
from _rloo import train_parallel, trl_reference  # noqa: E402

WORLD_SIZE = 2
TOL = 1e-5  # relative (|value| below 1e-3 counts as 1e-3), or 10 x the figure's fp32 noise floor where larger
# two iterations per generation: at this clip range some of the second step's sequences are clipped and some not
OPTIONS = {"num_iterations": 2, "epsilon": 0.5}
LAYOUTS = {
    "tp2": {"tensor_parallel_size": 2},
    # every length even, so sp splits every forward (it splits lengths tp divides)
    "tp2-sp": {"tensor_parallel_size": 2, "sequence_parallel": True, "pad_to_multiple_of": 2},
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return save_tiny_llama(str(tmp_path_factory.mktemp("hf") / "llama"))


@pytest.fixture(scope="module")
def pool4():
    workers = WorkerPool(4)
    yield workers
    workers.close()


def reference_and_floor(run, hf_dir: str, directory, **options) -> tuple[list[dict], dict]:
    """TRL's runs (`run(trl_reference, ...)`: one per process) from the weights and from the weights moved by 1e-7
    relative, which must draw the same completions (so the difference is fp32 rounding, not other samples): the
    runs from the weights and the noise floor of every figure (the largest over the processes)."""
    expected = run(trl_reference, hf_dir, str(directory / "reference"), fixed=False, **options)
    moved = run(trl_reference, perturbed_copy(hf_dir, directory / "moved"), str(directory / "moved_run"), fixed=False,
                **options)  # fmt: skip
    assert [m["drawn"] for m in moved] == [e["drawn"] for e in expected]
    floors = [noise_floor(e["every"], m["every"]) for e, m in zip(expected, moved, strict=True)]
    return expected, {key: max(floor[key] for floor in floors) for key in floors[0]}


@pytest.fixture(scope="module")
def one_process(hf_dir, tmp_path_factory) -> tuple[dict, dict]:
    """TRL on this process: its run (figures and draws) and the noise floor of every figure."""
    here = lambda fn, *a, **k: [fn(*a, **k)]  # noqa: E731 - run on this process, as the pools' run
    expected, noise = reference_and_floor(here, hf_dir, tmp_path_factory.mktemp("trl"), **OPTIONS)
    return expected[0], noise


def zero_sums(figures: dict) -> dict:
    """The losses that are 0 in exact arithmetic (a step that generated, and the evaluation: every ratio is 1 and the
    loss is minus the mean of the leave-one-out advantages, whose sum over a group is 0), with the scale of those
    advantages (the reward std) they are compared with: what is logged is an fp32 residual of ~1e-8."""
    found = {}
    for step, values in figures.items():
        if "reward_std" in values:
            found[(step, "loss")] = values["reward_std"]
        if "eval_reward_std" in values:
            found[(step, "eval_loss")] = values["eval_reward_std"]
    return found


def leave_out(figures: dict, places) -> dict:
    return {step: {k: v for k, v in values.items() if (step, k) not in places} for step, values in figures.items()}


def check_reference(expected: dict) -> None:
    """The run compared with exercises what it should: 2 training generations and 2 evaluation batches, prompts and
    completions of several lengths, some completions cut at the limit, clipping, a kl, gradients."""
    assert len(expected["drawn"]) == 4  # 2 training generations (2 iterations each), 2 evaluation batches
    assert sorted(expected["every"]) == [1, 2, 3] and "eval_loss" in expected["every"][3]
    assert expected["every"][3]["kl"] != 0 and 0 < expected["every"][2]["clip_ratio/region_mean"] < 1
    assert all(expected["every"][step]["grad_norm"] > 0 for step in (1, 2, 3))
    drawn = [ids for batch in expected["drawn"] for ids in batch]
    assert len({len(ids) for ids in drawn}) > 2  # several lengths: padding on the right
    assert any(len(ids) == COMPLETION_LENGTH and ids[-1] != EOS for ids in drawn)  # cut at the limit
    assert any(len(ids) < COMPLETION_LENGTH and ids[-1] == EOS for ids in drawn)  # ended by EOS
    zero = zero_sums(expected["every"])
    assert sorted(zero) == [(1, "loss"), (3, "eval_loss"), (3, "loss")] and abs(expected["every"][2]["loss"]) > 1e-3


def check_figures(name: str, rank: int, got: dict, expected: dict, noise: dict) -> dict[str, float]:
    """Every figure within TOL relative or 10 x its noise floor; the 0-in-theory losses within TOL of the reward std.
    The worst relative error per figure."""
    zero = zero_sums(expected)
    worst = check_against(leave_out(got, zero), leave_out(expected, zero), noise, TOL)
    for (step, key), scale in zero.items():
        error = abs(got[step][key] - expected[step][key]) / scale
        assert error <= TOL, (name, rank, step, key, got[step][key], expected[step][key])
        worst[f"{key} (of the reward std)"] = max(worst.get(f"{key} (of the reward std)", 0.0), error)
    return worst


def report(name: str, worst: dict, noise: dict) -> None:
    print(f"\n{name}: worst relative error per figure", {k: f"{v:.1e}" for k, v in sorted(worst.items()) if v})
    print("fp32 noise floor:", {k: f"{v:.1e}" for k, v in sorted(noise.items()) if v})


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_replica_draws_what_trl_draws_on_one_process(pool, hf_dir, one_process, tmp_path, layout):
    """Every rank draws TRL's completions token by token; every figure within 1e-5 relative or 10 x its noise floor."""
    expected, noise = one_process
    check_reference(expected)
    results = pool.run(train_parallel, hf_dir, str(tmp_path), fixed=False, **LAYOUTS[layout], **OPTIONS)
    for rank, result in enumerate(results):
        assert result["drawn"] == expected["drawn"], (layout, rank)  # token by token, every generation
        worst = check_figures(layout, rank, result["every"], expected["every"], noise)
        if rank == 0:
            report(layout, worst, noise)


def evaluation_losses(processes: list[dict]) -> tuple[float, float]:
    """From the losses of TRL's evaluation batches on each process (6 completions each): the evaluation loss of the
    whole batches (TRL's one-process figure, which ParallelRLOOTrainer logs at dp) and the one TRL logs on 2
    processes, whose accelerate `gather_for_metrics` keeps, of the last batch, the first len(eval dataset) % global
    batch = 6 % 12 = 6 losses gathered (the prompts are counted, not their completions): process 0's share only."""
    losses = [process["eval_losses"] for process in processes]
    assert [len(batches) for batches in losses] == [2, 2], losses
    whole = sum(map(sum, losses)) / 4
    kept = (sum(losses[0]) + sum(losses[1][:-1])) / 3
    return whole, kept


def test_dp2_tp2_draws_what_trl_draws_on_two_processes(pool, pool4, hf_dir, tmp_path):
    """Each replica draws its TRL process's completions token by token (the processes seeded apart draw apart), and
    every figure is within 1e-5 relative or 10 x its noise floor of TRL's on 2 processes. Each process holds 6 of
    the 12 completions, so the second prompt's group of 4 straddles the processes (replicas). The evaluation loss is
    the whole batches' (TRL's one-process figure; TRL on 2 processes leaves half of the last batch out of it, see
    `evaluation_losses`): both are checked against the losses of TRL's evaluation batches."""
    per_process = {"per_device_train_batch_size": 6, **OPTIONS}
    expected, noise = reference_and_floor(pool.run, hf_dir, tmp_path, **per_process)
    assert expected[0]["drawn"] != expected[1]["drawn"]  # each process its own prompts and seed
    assert expected[0]["every"] == expected[1]["every"]  # TRL's figures are its processes' gathered ones
    for process in expected:
        check_reference(process)
    whole, kept = evaluation_losses(expected)
    logged, scale = expected[0]["every"][3]["eval_loss"], expected[0]["every"][3]["eval_reward_std"]
    assert abs(logged - kept) <= TOL * scale, (logged, kept)  # TRL's 2-process figure, explained
    assert abs(logged - whole) > 100 * TOL * scale, (logged, whole)  # ... and not the whole batches'
    results = pool4.run(train_parallel, hf_dir, str(tmp_path / "parallel"), fixed=False, tensor_parallel_size=2,
                        sharding_level=3, **per_process)  # fmt: skip
    assert sorted(r["replica"] for r in results) == [0, 0, 1, 1]
    for rank, result in enumerate(results):
        twin = expected[result["replica"]]
        assert result["drawn"] == twin["drawn"], (rank, result["replica"])  # token by token, every generation
        want = {step: dict(values) for step, values in twin["every"].items()}
        want[3]["eval_loss"] = whole  # compared relative to the reward std (`zero_sums`): 0 in exact arithmetic
        worst = check_figures("dp2 x tp2", rank, result["every"], want, noise)
        if rank == 0:
            report("dp2 x tp2 (level 3)", worst, noise)
            print(f"eval_loss: {result['every'][3]['eval_loss']:.3e} (whole batches {whole:.3e}; TRL on 2 processes "
                  f"logs {logged:.3e}, of the reward std {scale:.3e})")  # fmt: skip
