"""ParallelRLOOTrainer under pipeline parallelism (gloo): at pp=2 (2 ranks) and pp=2 x tp=2 (4 ranks), with TRL's real
generation (temperature 1, nothing fixed), every rank draws, token by token, the completions TRL's RLOOTrainer draws on
one process at the same seed, and logs every figure TRL logs (loss, grad norm, kl, rewards and their std, entropy, clip
ratios, lengths, ...; the evaluation's after step 3) within 1e-5 relative or 10 x the figure's fp32 noise floor (TRL's
run from weights perturbed by 1e-7 relative, which must draw the same completions). Prompts of 2-6 tokens are
left-padded, completions of 1-8 right-padded; two iterations per generation, so the second step's policy has moved
from the one that scored the completions (`old_logps`) and some of its sequences are clipped. pp with cp is refused by
name before anything runs."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from _dpo import check_against, noise_floor, perturbed_copy  # noqa: E402
from _grpo import grpo_args, save_tiny_llama  # noqa: E402
from _pool import WorkerPool  # noqa: E402
from _rloo import common  # noqa: E402
from test_trl_rloo import refused  # noqa: E402 - a trainer built on every rank: the ValueError's message

WORLD_SIZE = 2
TOL = 1e-5  # relative (|value| below 1e-3 counts as 1e-3), or 10 x the figure's fp32 noise floor where larger
# two iterations per generation: the second step's policy has moved from the one that scored the completions; at this
# clip range some of its sequences are clipped (no gradient) and some not
OPTIONS = {"num_iterations": 2, "epsilon": 0.5}


class RecordedCompletions:
    """TRL's real generation, each call's completion ids kept in order (`self.drawn`): the tokens a layout sampled."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
        out = super()._generate_single_turn(prompt_ids, images, multimodal_fields)
        self.__dict__.setdefault("drawn", []).append([list(map(int, ids)) for ids in out])
        return out


def trl_sampled(hf_dir: str, output_dir: str, **options) -> dict:
    """TRL's RLOOTrainer on this one process, sampling: every figure it logged per step and the completions drawn."""
    from _grpo import every_figure
    from trl import RLOOConfig, RLOOTrainer

    class SampledRLOOTrainer(RecordedCompletions, RLOOTrainer):
        pass

    trainer = SampledRLOOTrainer(hf_dir, args=RLOOConfig(**grpo_args(output_dir, **options)), **common(hf_dir))
    trainer.train()
    return {"every": every_figure(trainer.state.log_history), "drawn": trainer.drawn}


def parallel_sampled(hf_dir: str, output_dir: str, **options) -> dict:
    """ParallelRLOOTrainer on this rank, sampling: every figure it logged per step and the completions drawn."""
    import torch
    from _grpo import every_figure

    from optimum_parallel.integrations.trl import ParallelRLOOConfig, ParallelRLOOTrainer

    class SampledParallelRLOOTrainer(RecordedCompletions, ParallelRLOOTrainer):
        pass

    args = ParallelRLOOConfig(**grpo_args(output_dir, **options))
    trainer = SampledParallelRLOOTrainer(hf_dir, args=args, model_kwargs={"dtype": torch.float32}, **common(hf_dir))
    trainer.train()
    return {"every": every_figure(trainer.state.log_history), "drawn": trainer.drawn}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return save_tiny_llama(str(tmp_path_factory.mktemp("hf") / "llama"))


@pytest.fixture(scope="module")
def reference(hf_dir, tmp_path_factory) -> tuple[dict, dict]:
    """TRL on this process from the weights and from the weights moved by 1e-7 relative (the same draws, so the
    difference is fp32 rounding): its run and the noise floor of every figure."""
    expected = trl_sampled(hf_dir, str(tmp_path_factory.mktemp("ref")), **OPTIONS)
    moved = trl_sampled(perturbed_copy(hf_dir, tmp_path_factory.mktemp("moved")), str(tmp_path_factory.mktemp("ref")),
                        **OPTIONS)  # fmt: skip
    assert moved["drawn"] == expected["drawn"]
    return expected, noise_floor(expected["every"], moved["every"])


@pytest.fixture(scope="module")
def pool4():
    workers = WorkerPool(4)
    yield workers
    workers.close()


def zero_sums(figures: dict) -> dict:
    """The losses that are 0 in exact arithmetic: where the policy is the one that scored the completions (a step
    that generated, and the evaluation) every ratio is 1 and the loss is minus the mean of the leave-one-out
    advantages, whose sum over a group is 0. What is logged is the fp32 residual of that sum (~1e-8, a few ulps of
    the advantages), so it is compared with the advantages' scale (the reward std), not with itself."""
    found = {}
    for step, values in figures.items():
        if "reward_std" in values:
            found[(step, "loss")] = values["reward_std"]
        if "eval_reward_std" in values:
            found[(step, "eval_loss")] = values["eval_reward_std"]
    return found


def leave_out(figures: dict, places) -> dict:
    return {step: {k: v for k, v in values.items() if (step, k) not in places} for step, values in figures.items()}


def check_layout(name: str, results: list[dict], reference: tuple[dict, dict]) -> None:
    expected, noise = reference
    assert len(expected["drawn"]) == 4  # 2 training generations (2 iterations each), 2 evaluation batches
    assert sorted(expected["every"]) == [1, 2, 3] and "eval_loss" in expected["every"][3]
    assert expected["every"][3]["kl"] != 0 and 0 < expected["every"][2]["clip_ratio/region_mean"] < 1
    assert all(expected["every"][step]["grad_norm"] > 0 for step in (1, 2, 3))
    lengths = {len(ids) for batch in expected["drawn"] for ids in batch}
    assert len(lengths) > 1, lengths  # completions of several lengths: padding on the right too
    zero = zero_sums(expected["every"])
    assert sorted(zero) == [(1, "loss"), (3, "eval_loss"), (3, "loss")] and abs(expected["every"][2]["loss"]) > 1e-3
    for rank, result in enumerate(results):
        assert result["drawn"] == expected["drawn"], (name, rank)  # token by token, every generation
        worst = check_against(leave_out(result["every"], zero), leave_out(expected["every"], zero), noise, TOL)
        for (step, key), scale in zero.items():
            error = abs(result["every"][step][key] - expected["every"][step][key]) / scale
            assert error <= TOL, (name, rank, step, key, result["every"][step][key], expected["every"][step][key])
            worst[f"{key} (of the reward std)"] = max(worst.get(f"{key} (of the reward std)", 0.0), error)
        if rank == 0:
            print(f"\n{name}: worst relative error per figure", {k: f"{v:.1e}" for k, v in sorted(worst.items()) if v})
            print("fp32 noise floor:", {k: f"{v:.1e}" for k, v in sorted(noise.items()) if v})


def test_pp2_draws_and_logs_what_trl_does_on_one_process(pool, hf_dir, reference, tmp_path):
    results = pool.run(parallel_sampled, hf_dir, str(tmp_path), pipeline_parallel_size=2, **OPTIONS)
    check_layout("pp2", results, reference)


def test_pp2_tp2_draws_and_logs_what_trl_does_on_one_process(pool4, hf_dir, reference, tmp_path):
    """pp x tp: generation samples from the whole vocabulary, the pipeline's scoring reads each tp rank's slice."""
    results = pool4.run(parallel_sampled, hf_dir, str(tmp_path), pipeline_parallel_size=2, tensor_parallel_size=2,
                        **OPTIONS)  # fmt: skip
    check_layout("pp2 x tp2", results, reference)


def test_pp_with_cp_is_refused_by_name(pool4, hf_dir, tmp_path):
    for message in pool4.run(refused, hf_dir, str(tmp_path), {"pipeline_parallel_size": 2, "context_parallel_size": 2}):
        assert "pipeline_parallel_size=2 with context_parallel_size=2 is not supported" in message, message
        assert "allowed with pp > 1: context_parallel_size=1" in message, message
