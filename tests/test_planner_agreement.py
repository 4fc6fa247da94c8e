"""The planner proposes exactly the layouts the engine runs (issue 43): for a few families built from transformers'
config classes on the meta device, every layout of 1, 2, 4 and 8 ranks (tp x pp x cp x dp, SP on and off where
tp > 1, every ep dividing dp x cp, every sharding level where dp x cp > 1) is given to the engine's `validate` over a
mesh of sizes alone, through the family's own Parallelizer (`Parallelizer.validate`), and the set it accepts must be the
set `MemoryPlanner.candidate_layouts` yields, each of which the planner can estimate. No process, no weights."""

from __future__ import annotations

import importlib
import itertools

import family_matrix
import pytest
import torch
from _models import tiny_config
from transformers import AutoModelForCausalLM

from optimum_parallel.data_parallel.levels import DataParallelConfig
from optimum_parallel.frontends.manager import ParallelizersManager
from optimum_parallel.memory_planner.estimate import MemoryPlanner
from optimum_parallel.memory_planner.workload import Layout, Workload
from optimum_parallel.mesh import SimulatedMesh

MESH_MODULE = importlib.import_module("optimum_parallel.mesh.init")
WORLDS = (1, 2, 4, 8)
WORKLOAD = Workload(seq_len=128, dtype="fp32")  # long enough for the planner to try every cp of 8 ranks
MOE = dict(num_experts_per_tok=2, intermediate_size=64)
JAMBA = dict(MOE, **family_matrix.FAMILIES["jamba"])  # the family matrix's tiny Jamba (its own mixer sizes)
# name -> (model type, config overrides, the dims > 1 the engine runs on it); every model has 4 heads (2 kv) and 2
# layers, so tp=8 and pp > 2 are refused everywhere
FAMILIES = {
    "llama": ("llama", {}, {"pp", "cp"}),
    "mixtral": ("mixtral", dict(MOE, num_local_experts=4), {"pp", "cp", "ep"}),
    # the pipeline's stages pass hidden states only, so a router aux loss would be dropped: pp > 1 is refused
    "qwen3_moe, router logits": (
        "qwen3_moe",
        dict(MOE, num_experts=4, moe_intermediate_size=32, mlp_only_layers=[], output_router_logits=True),
        {"cp", "ep"},
    ),
    "gemma": ("gemma", dict(head_dim=16), {"pp", "cp"}),
    "gemma2": ("gemma2", dict(head_dim=16, sliding_window=8), {"pp", "cp"}),
    "jamba (Mamba mixers under cp: their heads split over it)": ("jamba", JAMBA, {"pp", "ep", "cp"}),
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def grid(world: int):
    """Every layout of `world` ranks the planner could name (SP only where tp > 1, levels only where dp x cp > 1)."""
    for tp in _divisors(world):
        for pp in _divisors(world // tp):
            for cp in _divisors(world // (tp * pp)):
                dp = world // (tp * pp * cp)
                levels = (0, 1, 2, 3) if dp * cp > 1 else (0,)
                sps = (False, True) if tp > 1 else (False,)
                for ep, level, sp in itertools.product(_divisors(dp * cp), levels, sps):
                    yield Layout(dp, tp, pp, level, sp, cp, ep=ep)


def family_refusal(model, family, layout: Layout, monkeypatch) -> str | None:
    """What the family's own Parallelizer says of `layout` (`Parallelizer.validate`: the engine's checks of the request
    `parallelize` would make) over the current mesh, here a mesh of sizes alone; None if it accepts it."""
    mesh = SimulatedMesh(layout.tp, sizes=dict(dp=layout.dp, pp=layout.pp, cp=layout.cp, ep=layout.ep))
    monkeypatch.setattr(MESH_MODULE, "_CURRENT_MESH", mesh)  # what `get_mesh()` returns; undone after the test
    data_parallel = DataParallelConfig(layout.sharding_level) if layout.data_parallel > 1 else None
    try:
        family.validate(
            model,
            sequence_parallel_enabled=layout.sequence_parallel,
            pipeline_parallel_num_microbatches=layout.pp,
            data_parallel=data_parallel,
        )
    except (ValueError, NotImplementedError) as err:
        return str(err)
    return None


CELLS: dict[str, int] = {}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_planner_proposes_exactly_what_the_engine_accepts(name, monkeypatch):
    model_type, overrides, dims = FAMILIES[name]
    config = tiny_config(model_type, **overrides)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    family = ParallelizersManager.parallelizer_for_model(model)  # as the entry points pick it
    planner = MemoryPlanner(config)
    cells = {world: list(grid(world)) for world in WORLDS}
    answers = {
        layout: family_refusal(model, family, layout, monkeypatch) for layouts in cells.values() for layout in layouts
    }
    accepted = {layout for layout, why in answers.items() if why is None}
    for world, layouts in cells.items():
        proposed = set(planner.candidate_layouts(world, WORKLOAD))
        expected = accepted & set(layouts)
        assert proposed == expected, (
            f"{name}, {world} ranks: proposed, not accepted: {sorted(map(str, proposed - expected))}; accepted, not "
            f"proposed: {sorted(map(str, expected - proposed))}"
        )
        assert len(planner.suggest(world, 1e18, WORKLOAD)) == len(proposed)  # and each one can be estimated
    # a refused layout's estimate raises the engine's own error
    layout, why = next((layout, why) for layout, why in answers.items() if why is not None)
    with pytest.raises((ValueError, NotImplementedError)) as refused:
        planner.estimate(layout, WORKLOAD)
    assert str(refused.value).split(":")[0] == why.split(":")[0]  # the engine's message (the planner's key names)
    # the dims the engine runs on this model; sequence parallelism with pp > 1 among them where both run (the
    # drift issue 43 found: tests/test_pipeline.py runs pp2-tp2-sp)
    used = {dim for layout in accepted for dim in ("pp", "cp", "ep") if getattr(layout, dim) > 1}
    assert used == dims, used
    assert not any(layout.tp == 8 for layout in accepted)  # 4 attention heads: the family's own check refuses tp=8
    assert any(layout.sequence_parallel and layout.pp > 1 for layout in accepted) == ("pp" in dims)
    CELLS[name] = len(answers)
    print(f"\n{name}: {len(answers)} layouts of 1-8 ranks, {len(accepted)} accepted; e.g. refused {layout}: {why}")


def test_grid_size_is_recorded():
    """The number of (family, layout) cells the agreement walks (printed for the issue's note)."""
    if len(CELLS) < len(FAMILIES):
        pytest.skip("run with the agreement tests")
    total = sum(CELLS.values())
    print(f"\nplanner/engine agreement grid: {total} (family, layout) cells over {len(CELLS)} families")
    assert total > 1000
