"""A handful of the family matrix (`make test-families` runs the whole of it, tests/family_matrix.py): today's
families at the layouts their structure allows, against one process on the whole batch, or refused before anything
changes naming the layer that blocks them."""

from __future__ import annotations

import pytest
from family_matrix import WORLD_SIZE, check_layout, noise_floor, verdict

__all__ = ["WORLD_SIZE"]  # the pool's size

CELLS = [
    ("qwen3_5_text", "tp2+sp", "equal"),  # gated delta nets beside attention, sequence-parallel residual stream
    ("qwen3_5_text", "cp2", "equal"),  # the delta net on the whole sequence, its heads split over cp
    ("gemma4_text", "cp2", "equal"),
    ("falcon_h1", "pp2", "equal"),  # final_layernorm found by role; its layers return tuples
    ("jamba", "tp2xdp2-L3", "equal"),
    ("deepseek_v3", "ep2", "equal"),
    ("gpt_oss", "cp2", "equal"),  # attention sinks, joined after the ring's merge
    ("llama4_text", "cp2", "equal"),  # chunked attention: its chunks and the cp chunks cut at different places
    ("gemma3", "cp2", "equal"),  # an image's tokens attend both ways, one image across a cp chunk boundary
    ("qwen2_5_vl", "tp2+sp", "equal"),
]


@pytest.mark.parametrize("model_type,layout,expected", CELLS, ids=[f"{t}-{lay}" for t, lay, _ in CELLS])
def test_family_layout(pool, model_type, layout, expected):
    results = pool.run(check_layout, model_type, layout)
    outcome, detail = verdict(results, noise_floor(model_type))
    assert outcome == expected, f"{model_type} at {layout}: {outcome}: {detail}"
    if outcome == "refused":
        assert "allowed for this model" in detail and ("layers." in detail or "For" in detail), detail


def test_readme_table_is_the_pinned_matrix():
    """The README's support table is the pinned matrix (`tests/families/expected_matrix.json`, which every cell of
    `make test-families` is compared with), written by `python scripts/supported_models.py --readme`."""
    from importlib.util import module_from_spec, spec_from_file_location
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = spec_from_file_location("supported_models", root / "scripts" / "supported_models.py")
    supported = module_from_spec(spec)
    spec.loader.exec_module(supported)
    readme = (root / "README.md").read_text()
    expected = supported.table(supported.read_pins())
    assert expected in readme, "README's support table differs: `python scripts/supported_models.py --readme`"
    assert supported.counts_of_pins(supported.read_pins()) in readme
