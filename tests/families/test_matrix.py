"""The whole family matrix (`make test-families`): every family of `family_matrix.FAMILIES` at every layout its
structure allows, against one process on the whole batch, or refused before anything changes naming the module.

Each cell is appended to the results file `OP_MATRIX_RESULTS` (default `build/family-matrix.jsonl`), which
`scripts/supported_models.py --results FILE` turns into the README's support table, and compared with the pinned
table (`tests/families/expected_matrix.json`): a cell that turns from equal to refused, or from one refusal to
another, fails, and so does a held share that moves."""

from __future__ import annotations

import os
from functools import cache
from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path

import pytest
from family_matrix import WORLD_SIZE, check_layout, layouts_for, model_types, noise_floor, record, verdict

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "supported_models.py"
supported = module_from_spec(spec := spec_from_file_location("supported_models", SCRIPT))
spec.loader.exec_module(supported)
PINNED = supported.read_pins()  # model type -> layout -> "equal" / "refused: <layer>", "held" -> share at tp=2
HELD_GOAL = 0.75  # at tp=2 (with sp, or with FSDP2 over dp too): every mixer, attention and MLP split
RESULTS = Path(os.environ.get("OP_MATRIX_RESULTS", "build/family-matrix.jsonl"))
CELLS = [(model_type, layout) for model_type in model_types() for layout in layouts_for(model_type)]
__all__ = ["WORLD_SIZE"]  # the pool's size


@cache
def floor(model_type: str) -> dict[str, float]:
    return noise_floor(model_type)


@pytest.fixture(scope="module", autouse=True)
def fresh_results():
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("")


@pytest.mark.parametrize("model_type,layout", CELLS, ids=[f"{t}-{lay}" for t, lay in CELLS])
def test_family_layout(pool, model_type, layout):
    try:
        results = pool.run(check_layout, model_type, layout)
    except (AssertionError, TimeoutError) as err:  # a rank raised something other than a refusal
        last = [line for line in str(err).splitlines() if line.strip()][-1]
        record(RESULTS, model_type, layout, "FAILED", last[:300], None)
        raise
    outcome, detail = verdict(results, floor(model_type))
    held = results[0].get("held")
    record(RESULTS, model_type, layout, outcome, detail, held)
    assert outcome != "FAILED", f"{model_type} at {layout}: {detail} ({results[0]})"
    assert held is None or held <= HELD_GOAL, f"{model_type} at {layout}: one rank holds {held:.3f} of the parameters"
    pinned = PINNED.get(model_type, {})
    found = supported.cell_text(outcome, detail)
    assert found == pinned.get(layout), (
        f"{model_type} at {layout}: {found!r}, pinned {pinned.get(layout)!r} ({detail}); a change on purpose: "
        "`python scripts/supported_models.py --results build/family-matrix.jsonl --pin` after the whole matrix"
    )
    if held is not None:
        assert supported.held_text(held) == pinned.get("held"), f"{model_type}: holds {held:.3f}, pinned {pinned}"
    if outcome == "refused":  # one error naming what blocks it and what is allowed
        assert "allowed" in detail and ("model." in detail or "Model" in detail or "For" in detail), detail
