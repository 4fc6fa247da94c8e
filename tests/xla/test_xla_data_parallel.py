"""Data parallelism on XLA devices: dp=2 over two XLA devices of one process (sharding level 0, Paddle's `parallelize`)
equals one CPU process on the global batch: each step's loss, the logits, every gradient, 3 AdamW steps; sharding
levels 1-3 are refused before anything changes. dp=2 x tp=2 over four devices equals it too.

Each replica trains on its own rows of the global batch (padded, -100 labels, as many labelled tokens per replica),
so its own loss and gradient differ from the global ones: only gradients averaged over the dp ranks match the CPU.
Every check asserts a world of 2 first, so a run that fell back to one rank cannot pass.
"""

from __future__ import annotations

import re

import torch
from _common import STEPS, check_split_over_tp, check_world, rel_err, whole

TOL = 1e-5  # fp32, relative to the largest value of the tensor (as in the tp tests)


def _compare_replicas(results: list[dict], reference: dict, weight_tolerance: float) -> dict[str, float]:
    """The two replicas (each its tp ranks) against one CPU process on the global batch: the replicas' mean loss of
    every step, the logits (rows in replica order), and each replica's every gradient and weight, whole from its tp
    shards (every replica holds the same averaged gradient and the same weights)."""
    replicas = [[r for r in results if r["dp_rank"] == d] for d in (0, 1)]
    assert len(replicas[0]) == len(replicas[1]) == len(results) // 2, [r["dp_rank"] for r in results]
    worst = {}
    first = [replica[0]["losses"][0] for replica in replicas]
    assert abs(first[0] - first[1]) > 1e-3, first  # the replicas really train on different rows
    means = [sum(replica[0]["losses"][step] for replica in replicas) / 2 for step in range(STEPS)]
    worst["loss"] = max(
        rel_err(torch.tensor(a), torch.tensor(b)) for a, b in zip(means, reference["losses"], strict=True)
    )
    worst["logits"] = rel_err(torch.cat([replica[0]["logits"] for replica in replicas]), reference["logits"])
    assert worst["loss"] <= TOL and worst["logits"] <= TOL, worst
    assert set(results[0]["grads"]) == set(reference["grads"])
    for key, tol in (("grads", TOL), ("params", weight_tolerance)):
        errors = {}
        for d, replica in enumerate(replicas):
            for name, expected in reference[key].items():
                errors[(d, name)] = rel_err(whole([r[key][name] for r in replica], expected.shape), expected)
        where = max(errors, key=errors.get)
        worst[key] = errors[where]
        assert errors[where] <= tol, f"{key} of {where[1]} on replica {where[0]}: relative error {errors[where]:.2e}"
    return worst


def test_dp2_on_two_xla_devices_equals_one_cpu_process_on_the_global_batch(
    scenarios, cpu_reference_dp2, weight_tolerance
):
    results = scenarios("dp2")
    check_world(results, 2)
    for r in results:  # every replica holds whole gradients and weights
        split = [(key, name) for key in ("grads", "params") for name, (_, dim, _) in r[key].items() if dim is not None]
        assert not split, f"{split} are split at dp=2"
    worst = _compare_replicas(results, cpu_reference_dp2, weight_tolerance)
    print(f"\n[xla] dp2 worst relative errors: {worst}")


def test_both_replicas_run_the_compiled_graphs_of_one_device(scenarios):
    """The gradient all-reduce holds no rank: the two devices together compile what one device running the same loop
    compiles (a graph with a rank in it would be compiled once per device)."""
    assert scenarios("dp2")[0]["compiles"] == scenarios("dp1")[0]["compiles"]


def test_sharding_levels_1_to_3_are_refused_on_xla_before_anything_changes(scenarios):
    """Each rank's `parallelize` at levels 1-3 raised, naming the key and the one level XLA allows, and the worker
    checked that the model's parameters, gradients, hooks and class and the optimizer were left as they were."""
    results = scenarios("dp2")
    check_world(results, 2)
    for r in results:
        assert sorted(r["refusals"]) == [1, 2, 3], r["refusals"]
        for level, message in r["refusals"].items():
            expected = (
                rf"dp_config\['sharding_level'\]={level} is not supported on XLA devices \(.*\); allowed on XLA: 0 "
            )
            assert re.match(expected, message), message
        assert "ZeroRedundancyOptimizer" in r["refusals"][1]
        assert "DeviceMesh" in r["refusals"][2] and "DeviceMesh" in r["refusals"][3]


def test_dp2_x_tp2_on_four_xla_devices_equals_one_cpu_process_on_the_global_batch(
    scenarios, cpu_reference_dp2, weight_tolerance
):
    """The Parallelizer's tp=2, then `parallelize` with dp_config level 0: each tp shard's gradient is averaged over
    its two replicas."""
    results = scenarios("dp2tp2")
    check_world(results, 4)
    check_split_over_tp(results[0])
    worst = _compare_replicas(results, cpu_reference_dp2, weight_tolerance)
    print(f"\n[xla] dp2 x tp2 worst relative errors: {worst}")


def test_dp2_x_tp2_ranks_run_the_compiled_graphs_of_one_device(scenarios):
    """No graph holds a rank at dp x tp either: each of the four devices compiles what one device running the
    Parallelizer's loop compiles."""
    one_device = scenarios("tp1")[0]["compiles"]
    assert [r["compiles"] for r in scenarios("dp2tp2")] == [one_device] * 4
