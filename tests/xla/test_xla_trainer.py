"""ParallelTrainer on XLA devices equals transformers' Trainer on the CPU: the loss and the (clipped) grad norm of 3
AdamW steps and the weights after, with one sync per optimizer step, no value read from the device during training,
and on two devices the compiled graphs of one.

The reference is transformers' own Trainer in a CPU process (torch-xla switched off); tp=1 runs on one XLA device,
tp=2 on two XLA devices of one process (a thread each, as in test_xla_tensor_parallel.py: accelerate keeps its state
per thread on XLA, so two Trainers run side by side). Every multi-rank check asserts a world of 2 first.
"""

from __future__ import annotations

import pytest
import torch
from _common import STEPS, rel_err, whole

TOL = 1e-5  # fp32, relative
WEIGHT_TOL = 2e-3  # AdamW divides by sqrt(v): float-noise gradients move weights by up to lr (see the tp tests)


@pytest.fixture(scope="module")
def reference(scenarios) -> dict:
    (result,) = scenarios("trainer-cpu")
    assert result["device"] == "cpu" and len(result["losses"]) == STEPS
    return result


def _check(results: list[dict], reference: dict, world: int) -> None:
    assert len(results) == world and sorted(r["ordinal"] for r in results) == list(range(world))
    assert all(r["world"] == world for r in results), [r["world"] for r in results]
    for r in results:
        assert r["device"].startswith("xla"), r["device"]
        for key in ("losses", "grad_norms"):
            assert len(r[key]) == STEPS, (key, r[key])
            errors = [rel_err(torch.tensor(a), torch.tensor(b)) for a, b in zip(r[key], reference[key], strict=True)]
            assert max(errors) <= TOL, f"rank {r['ordinal']} {key}: {r[key]} vs {reference[key]}"
    for name, expected in reference["params"].items():
        held = whole([r["params"][name] for r in results], expected[0].shape)
        assert rel_err(held, expected[0]) <= WEIGHT_TOL, name


def _check_syncs(results: list[dict]) -> None:
    """One sync per optimizer step on every rank (transformers' per-batch device loader and its token-count gather
    would add more), and no device-to-host transfer while training (no `.item()` in the step)."""
    for r in results:
        begin, steps = r["begin"], r["steps"]
        assert [s["syncs"] - begin["syncs"] for s in steps] == list(range(1, STEPS + 1)), (begin, steps)
        assert [s["transfers"] - begin["transfers"] for s in steps] == [0] * STEPS, (begin, steps)


def test_parallel_trainer_on_one_xla_device_equals_the_cpu_trainer(scenarios, reference):
    results = scenarios("trainer-tp1")
    _check(results, reference, 1)
    _check_syncs(results)


def test_parallel_trainer_at_tp2_on_two_xla_devices_equals_the_cpu_trainer(scenarios, reference):
    results = scenarios("trainer-tp2")
    _check(results, reference, 2)
    _check_syncs(results)
    split = [name for name, (_, dim, _) in results[0]["params"].items() if dim is not None]
    assert any(name.endswith("q_proj.weight") for name in split), split  # really tensor-parallel


def test_the_trainer_graphs_hold_no_rank(scenarios):
    """Both devices together compile what one device compiles (the step graph before and after the optimizer has
    state): the grad norm weighs other ranks' pieces by 0 given as data, not by leaving them out."""
    one = scenarios("trainer-tp1")[0]["steps"][-1]["compiles"]
    assert scenarios("trainer-tp2")[0]["steps"][-1]["compiles"] == one
