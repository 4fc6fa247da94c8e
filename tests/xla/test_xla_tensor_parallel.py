"""Tensor (and sequence) parallelism on XLA devices equals one CPU process: logits, loss, every gradient, 3 AdamW
steps.

tp=1 runs on one XLA device; tp=2 on two XLA devices of one process (torch_xla.launch, a thread per rank: PJRT's
CPU client has no collectives between processes). Every multi-rank check asserts a world of 2 first, so a run
that fell back to one rank cannot pass.
"""

from __future__ import annotations

import pytest
import torch
from _common import check_split_over_tp, check_world, rel_err, whole

from optimum_parallel.checkpoint import consolidate_checkpoint

TOL = 1e-5  # fp32, relative to the largest value of the tensor


def _compare(results: list[dict], reference: dict, weight_tolerance: float) -> dict[str, float]:
    worst = {}
    worst["loss"] = max(  # the loss of every step, as every rank sees it
        rel_err(torch.tensor(a), torch.tensor(b))
        for r in results
        for a, b in zip(r["losses"], reference["losses"], strict=True)
    )
    worst["logits"] = max(rel_err(r["logits"], reference["logits"]) for r in results)  # whole on every rank
    assert set(results[0]["grads"]) == set(reference["grads"])
    for key, tol in (("grads", TOL), ("params", weight_tolerance)):
        errors = {}
        for name, expected in reference[key].items():
            errors[name] = rel_err(whole([r[key][name] for r in results], expected.shape), expected)
        name = max(errors, key=errors.get)
        worst[key] = errors[name]
        assert errors[name] <= tol, f"{key} of {name}: relative error {errors[name]:.2e} > {tol}"
    assert worst["loss"] <= TOL and worst["logits"] <= TOL, worst
    print(f"\n[xla] worst relative errors: {worst}")
    return worst


def test_tp1_on_one_xla_device_equals_cpu(scenarios, cpu_reference, weight_tolerance):
    results = scenarios("tp1")
    check_world(results, 1)
    _compare(results, cpu_reference, weight_tolerance)


@pytest.mark.parametrize("scenario", ["tp2", "tp2-sp"])
def test_tp2_on_two_xla_devices_equals_one_cpu_process(scenarios, cpu_reference, scenario, weight_tolerance):
    results = scenarios(scenario)
    check_world(results, 2)
    check_split_over_tp(results[0])
    _compare(results, cpu_reference, weight_tolerance)


@pytest.mark.parametrize("scenario", ["tp2", "tp2-sp"])
def test_every_rank_runs_the_same_compiled_graphs(scenarios, scenario):
    """Graphs with no rank in them compile once for both devices: as many compilations as one device's run."""
    one_device = scenarios("tp1")[0]["compiles"]
    assert scenarios(scenario)[0]["compiles"] == one_device


def test_a_checkpoint_saved_from_xla_consolidates_to_the_cpu_weights(
    scenarios, cpu_reference, model_dir, tmp_path, weight_tolerance
):
    from safetensors.torch import load_file

    results = scenarios("tp2")
    check_world(results, 2)
    runs = scenarios.directory("tp2")
    original = load_file(model_dir / "model.safetensors")
    before = consolidate_checkpoint(runs / "ckpt-0", tmp_path / "ckpt-0", progress=False)
    saved = {k: v for f in sorted(before.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert set(saved) == set(original)
    for name, tensor in original.items():  # loaded on XLA, saved from XLA: the same bits
        assert torch.equal(saved[name], tensor), name
    after = consolidate_checkpoint(runs / "ckpt-3", tmp_path / "ckpt-3", progress=False)
    saved = {k: v for f in sorted(after.glob("*.safetensors")) for k, v in load_file(f).items()}
    for name, expected in cpu_reference["params"].items():
        held = whole([r["params"][name] for r in results], expected.shape)
        assert torch.equal(saved[name], held), f"{name}: the checkpoint is not what the XLA ranks held"
        assert rel_err(saved[name], expected) <= weight_tolerance, name


def test_pipeline_parallelism_is_refused_on_xla():
    """torch-xla runs each pipeline send/recv as a collective_permute plus a sync: refused with the reason, before any
    group is made."""
    from datetime import timedelta

    from optimum_parallel.mesh import MeshLayout
    from optimum_parallel.mesh.xla_mesh import XlaParallelMesh

    with pytest.raises(ValueError, match=r"pp=2 is not supported on XLA devices yet; allowed: pp=1 \(.*send/recv"):
        XlaParallelMesh(MeshLayout({"dp": 1, "pp": 2, "cp": 1, "tp": 1}), timedelta(seconds=5))
