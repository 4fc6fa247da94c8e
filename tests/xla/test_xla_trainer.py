"""ParallelTrainer on XLA devices equals transformers' Trainer on the CPU: the loss and the (clipped) grad norm of 3
AdamW steps and the weights after, with one sync per optimizer step, no value read from the device during training,
and on two devices the compiled graphs of one.

The reference is transformers' own Trainer in a CPU process (torch-xla switched off); tp=1 runs on one XLA device,
tp=2 and dp=2 on two XLA devices of one process (a thread each, as in test_xla_tensor_parallel.py: accelerate keeps
its state per thread on XLA, so two Trainers run side by side). At dp=2 the reference Trainer takes both replicas'
rows at once (4 a step, in the same shuffled order), and the replicas' labelled-token counts differ: the loss is
right only with the count of the global batch (`average_tokens_across_devices`, summed over dp in the graph). Every
multi-rank check asserts a world of 2 first.
"""

from __future__ import annotations

import re

import pytest
import torch
from _common import STEPS, check_world, rel_err, whole

TOL = 1e-5  # fp32, relative


def _reference(scenarios, scenario: str) -> dict:
    (result,) = scenarios(scenario)
    assert result["device"] == "cpu" and len(result["losses"]) == STEPS
    return result


@pytest.fixture(scope="module")
def reference(scenarios) -> dict:
    return _reference(scenarios, "trainer-cpu")


def _check(results: list[dict], reference: dict, world: int, weight_tolerance: float, dp: int = 1) -> dict[str, float]:
    """Each rank's grad norm, and its loss (at dp > 1 the ranks' mean, which the Trainer logs: each replica's own
    loss is its rows' share of the global batch's), equal the CPU Trainer's; so do the weights (every replica's)."""
    check_world(results, world)
    worst = {}
    for r in results:
        assert r["device"].startswith("xla"), r["device"]
        assert len(r["losses"]) == len(r["grad_norms"]) == STEPS, r
    logged = [sum(r["losses"][step] for r in results) / world for step in range(STEPS)]
    for key, rows in (
        ("losses", [logged] + ([r["losses"] for r in results] if dp == 1 else [])),
        ("grad_norms", [r["grad_norms"] for r in results]),
    ):
        errors = [
            rel_err(torch.tensor(a), torch.tensor(b)) for row in rows for a, b in zip(row, reference[key], strict=True)
        ]
        worst[key] = max(errors)
        assert worst[key] <= TOL, f"{key}: {rows} vs {reference[key]}"
    errors = {}
    for name, expected in reference["params"].items():
        for replica in range(dp):  # the tp ranks of each replica (rank order is dp-major)
            pieces = results[replica * (world // dp) : (replica + 1) * (world // dp)]
            errors[name, replica] = rel_err(whole([r["params"][name] for r in pieces], expected[0].shape), expected[0])
    where = max(errors, key=errors.get)
    worst["params"] = errors[where]
    assert errors[where] <= weight_tolerance, f"{where}: relative error {errors[where]:.2e}"
    return worst


def _check_syncs(results: list[dict]) -> None:
    """One sync per optimizer step on every rank (transformers' per-batch device loader and its token-count gather
    would add more), and no device-to-host transfer while training (no `.item()` in the step)."""
    for r in results:
        begin, steps = r["begin"], r["steps"]
        assert [s["syncs"] - begin["syncs"] for s in steps] == list(range(1, STEPS + 1)), (begin, steps)
        assert [s["transfers"] - begin["transfers"] for s in steps] == [0] * STEPS, (begin, steps)


def test_parallel_trainer_on_one_xla_device_equals_the_cpu_trainer(scenarios, reference, weight_tolerance):
    results = scenarios("trainer-tp1")
    worst = _check(results, reference, 1, weight_tolerance)
    _check_syncs(results)
    print(f"\n[xla] trainer-tp1 worst relative errors: {worst}")


def test_parallel_trainer_at_tp2_on_two_xla_devices_equals_the_cpu_trainer(scenarios, reference, weight_tolerance):
    results = scenarios("trainer-tp2")
    worst = _check(results, reference, 2, weight_tolerance)
    _check_syncs(results)
    split = [name for name, (_, dim, _) in results[0]["params"].items() if dim is not None]
    assert any(name.endswith("q_proj.weight") for name in split), split  # really tensor-parallel
    print(f"\n[xla] trainer-tp2 worst relative errors: {worst}")


def test_parallel_trainer_at_dp2_on_two_xla_devices_equals_the_cpu_trainer_on_the_global_batch(
    scenarios, weight_tolerance
):
    results = scenarios("trainer-dp2")
    worst = _check(results, _reference(scenarios, "trainer-cpu-dp2"), 2, weight_tolerance, dp=2)
    _check_syncs(results)
    first = [r["losses"][0] for r in results]
    assert abs(first[0] - first[1]) > 1e-3, first  # the replicas really train on different rows
    print(f"\n[xla] trainer-dp2 worst relative errors: {worst}")


def test_parallel_trainer_refuses_zero1_on_xla(scenarios):
    """ParallelTrainingArguments(sharding_level=1) at dp=2 on XLA: the Trainer raises before the model changes."""
    results = scenarios("trainer-dp2")
    check_world(results, 2)
    for r in results:
        pattern = (
            r"sharding_level=1 is not supported on XLA devices \(.*ZeroRedundancyOptimizer.*\); allowed on XLA: 0 "
        )
        assert re.match(pattern, r["refusal"] or ""), r["refusal"]


@pytest.mark.parametrize("scenario", ["trainer-tp2", "trainer-dp2"])
def test_the_trainer_graphs_hold_no_rank(scenarios, scenario):
    """Both devices together compile what one device compiles (the step graph before and after the optimizer has
    state): the grad norm weighs other ranks' pieces by 0 given as data, not by leaving them out, and the gradient
    and token-count all-reduces of dp hold no rank either."""
    one = scenarios("trainer-tp1")[0]["steps"][-1]["compiles"]
    assert scenarios(scenario)[0]["steps"][-1]["compiles"] == one
