"""The memory planner with expert parallelism: per-rank parameter, gradient and AdamW bytes of a tiny MoE checked
against the model actually parallelized (gloo, 4 ranks: dp=4 x ep=2 / ep=4, dp=2 x tp=2 x ep=2, pp=2 x dp=2 x ep=2,
at sharding levels 0-3), ep in `--suggest`, and the refusals."""

from __future__ import annotations

import pytest
import torch
from _models import build_model, tiny_config
from test_expert_parallel import MOE, replica_batch

from optimum_parallel.memory_planner.estimate import MemoryPlanner
from optimum_parallel.memory_planner.workload import Layout, Workload

WORLD_SIZE = 4
FP32 = Workload(dtype="fp32", seq_len=16, micro_batch=2)


def _config(model_type: str, pp: int):
    return tiny_config(model_type, **MOE[model_type], **({"num_hidden_layers": 4} if pp > 1 else {}))


def _nbytes(tensors) -> int:
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def held_bytes(model_type: str, sizes: dict, level: int = 0) -> dict:
    """Bytes of this rank's parameters, gradients and AdamW state after one step of the parallelized model at
    sharding `level`. Parameters as the step holds them at its peak: sharded at level 3, whole (this rank's tp / ep
    block) below, as FSDP2 keeps them gathered from forward to backward at level 2."""
    import optimum_parallel as op

    mesh = op.init_mesh(**sizes)
    pp = sizes.get("pp", 1)
    model = build_model(_config(model_type, pp))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if mesh.tp_size > 1 or pp > 1:
        parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
        model = parallelizer.parallelize(model, pipeline_parallel_num_microbatches=pp)
        optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
    model, optimizer = op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": level}})
    batch = replica_batch(model.config, mesh.data_parallel_size)
    replica = mesh.data_parallel_rank
    local = {k: v[2 * replica : 2 * replica + 2] for k, v in batch.items()}
    if pp > 1:
        model.run_train(**local)
    else:
        model(**local).loss.backward()
    grads = _nbytes(p.grad for p in model.parameters())
    optimizer.step()
    params = _nbytes(model.parameters()) if level == 3 else sum(p.numel() * 4 for p in model.parameters())
    state = _nbytes(v for s in optimizer.state.values() for v in s.values())
    experts = _nbytes(p for n, p in model.named_parameters() if ".experts." in n)
    return {"params": params, "grads": grads, "state": state, "experts": experts, "tensors": len(optimizer.state)}


CASES = [
    ("mixtral", dict(dp=4, ep=2), 0),
    ("mixtral", dict(dp=4, ep=4), 0),
    ("mixtral", dict(dp=2, tp=2, ep=2), 0),
    ("qwen3_moe", dict(dp=2, tp=2, ep=2), 0),
    ("mixtral", dict(dp=4, ep=2), 1),
    ("mixtral", dict(dp=4, ep=2), 2),
    ("mixtral", dict(dp=4, ep=2), 3),
    ("qwen3_moe", dict(dp=4, ep=2), 3),
    ("mixtral", dict(dp=2, tp=2, ep=2), 3),
    ("mixtral", dict(dp=2, pp=2, ep=2), 0),
    ("mixtral", dict(dp=2, pp=2, ep=2), 3),
]


def _layout(sizes: dict, level: int, ep: int | None = None) -> Layout:
    return Layout(
        dp=sizes["dp"], tp=sizes.get("tp", 1), pp=sizes.get("pp", 1), sharding_level=level, ep=ep or sizes["ep"]
    )


@pytest.mark.parametrize(
    "model_type,sizes,level",
    CASES,
    ids=[f"{m}-{'_'.join(f'{k}{v}' for k, v in s.items())}-L{lv}" for m, s, lv in CASES],
)
def test_estimate_matches_the_parallelized_model(pool, model_type, sizes, level):
    held = pool.run(held_bytes, model_type, sizes, level)
    planner = MemoryPlanner(_config(model_type, sizes.get("pp", 1)))
    layout = _layout(sizes, level)
    estimate = planner.estimate(layout, FP32)
    assert estimate.parameters == max(h["params"] for h in held)
    assert estimate.gradients == max(h["grads"] for h in held)
    if level == 1:  # ZeRO-1 splits by whole tensors, unevenly: the mean over the ranks is what the planner divides
        assert estimate.optimizer_state == sum(h["state"] for h in held) / len(held)
    elif level >= 2:  # FSDP2 keeps AdamW's 4-byte step counter of every tensor on every rank (the planner divides it)
        worst = max(held, key=lambda h: h["state"])
        assert 0 <= worst["state"] - estimate.optimizer_state <= 4 * worst["tensors"]
    else:
        assert estimate.optimizer_state == max(h["state"] for h in held)
    plain = planner.estimate(_layout(sizes, level, ep=1), FP32)
    counts = planner.counts(layout.tp, layout.pp, layout.ep)
    assert estimate.activations > plain.activations  # the dispatched rows
    assert any(f"ep={sizes['ep']}" in note for note in estimate.notes)
    if level == 0:  # only the expert tensors shrink, by ep
        assert max(counts.expert_stage) * 4 == max(h["experts"] for h in held)
        assert plain.parameters - estimate.parameters == max(counts.expert_stage) * 4 * (sizes["ep"] - 1)
    if level >= 1:  # the experts' states are split over the ranks holding the same experts, dp x cp / ep of them
        replicas = sizes["dp"] // sizes["ep"]
        assert any(f"then / {replicas} (the dp x cp / ep ranks holding them)" in n for n in estimate.notes)


def test_suggest_proposes_ep_when_only_split_experts_fit():
    planner = MemoryPlanner(tiny_config("mixtral", **MOE["mixtral"]))
    by_ep = {ep: planner.estimate(Layout(dp=4, ep=ep), FP32).total for ep in (1, 2, 4)}
    assert by_ep[4] < by_ep[2] < by_ep[1]
    roomy = planner.suggest(4, by_ep[1] * 2, FP32, reserve=0)
    assert (roomy[0].layout.ep, roomy[0].layout.tp, roomy[0].layout.sharding_level) == (1, 1, 0)
    assert any(e.layout.ep == 2 for e in roomy) and any(e.layout.ep == 4 for e in roomy)
    tight = planner.suggest(4, (by_ep[2] + by_ep[1]) / 2, FP32, reserve=0)
    assert tight and tight[0].layout.ep == 2 and tight[0].layout.tp == 1 and tight[0].layout.sharding_level == 0
    # the engine runs ep at every sharding level and with pp: the planner proposes those too, after ep at level 0
    assert any(e.layout.ep > 1 and e.layout.sharding_level == 3 for e in roomy)
    assert any(e.layout.ep > 1 and e.layout.pp == 2 for e in roomy)
    dense = MemoryPlanner(tiny_config("llama"))
    assert all(e.layout.ep == 1 for e in dense.suggest(4, by_ep[1] * 2, FP32))


def test_sharding_levels_split_expert_states_over_their_replicas():
    """(dp=4, ep=2): dense states split over the 4 dp ranks, expert states (2 of 4 experts per rank) over the 2 ranks
    holding the same experts, as the engine shards them (ZeRO-1 / FSDP2 on `mesh.expert_replica_group`)."""
    planner = MemoryPlanner(tiny_config("mixtral", **MOE["mixtral"]))
    (dense, dense_tensors), (experts, expert_tensors) = planner.counts(1, 1, 2).split(0)
    assert dense and experts
    states = {}
    for level in range(4):
        est = planner.estimate(Layout(dp=4, ep=2, sharding_level=level), FP32)
        states[level] = (est.parameters, est.gradients, est.optimizer_state)
    whole = (dense + experts) * 4
    adamw = ((dense * 8 + 4 * dense_tensors) / 4, (experts * 8 + 4 * expert_tensors) / 2)
    assert states[0] == (whole, whole, whole * 2 + 4 * (dense_tensors + expert_tensors))
    assert states[1] == (whole, whole, sum(adamw))
    assert states[2] == (whole, dense + 2 * experts, sum(adamw))
    assert states[3] == (dense + 2 * experts, dense + 2 * experts, sum(adamw))
    # ep = dp x cp: one rank per expert block, nothing to split the experts over
    (dense4, _), (experts4, _) = planner.counts(1, 1, 4).split(0)
    assert planner.estimate(Layout(dp=4, ep=4, sharding_level=3), FP32).parameters == dense4 + experts4 * 4
    # under pp each stage counts its own layers' experts; activations add the dispatched rows of its MoE layers
    deep = MemoryPlanner(tiny_config("mixtral", **MOE["mixtral"], num_hidden_layers=4))
    stages = deep.counts(1, 2, 2)
    assert stages.expert_stage[0] == stages.expert_stage[1] == deep.counts(1, 1, 2).expert_stage[0] // 2
    piped = deep.estimate(Layout(dp=2, pp=2, ep=2, sharding_level=3), FP32)
    assert piped.parameters == max(d * 4 / 2 + x * 4 / 1 for (d, _), (x, _) in map(stages.split, range(2)))


def test_refusals_name_the_key_and_the_allowed_values():
    with pytest.raises(ValueError, match=r"ep=3 is not allowed; .* must divide dp x cp = 4 x 1; allowed: 1, 2, 4"):
        Layout(dp=4, ep=3)
    with pytest.raises(ValueError, match=r"shard_size=2 \(hybrid sharding\) with ep=2 is not supported yet; allowed"):
        Layout(dp=4, ep=2, sharding_level=3, shard_size=2)
    with pytest.raises(
        ValueError, match=r"ep=8 does not divide the 4 experts of 'model.layers.0.mlp.experts'; allowed: .*\(1, 2, 4\)"
    ):
        MemoryPlanner(tiny_config("mixtral", **MOE["mixtral"])).estimate(Layout(dp=8, ep=8), FP32)
    with pytest.raises(
        ValueError, match=r"ep=2: LlamaForCausalLM has no stacked experts module .* allowed for this model: ep=1"
    ):
        MemoryPlanner(tiny_config("llama")).estimate(Layout(dp=2, ep=2), FP32)


def test_cli_estimate_memory_with_ep(tmp_path):
    from click.testing import CliRunner

    from optimum_parallel.cli import main

    tiny_config("mixtral", **MOE["mixtral"]).save_pretrained(tmp_path)
    args = ["estimate-memory", str(tmp_path), "--dp", "4", "--ep", "2", "--dtype", "fp32", "--seq-len", "16"]
    result = CliRunner().invoke(main, args, prog_name="optimum-parallel")
    assert result.exit_code == 0, result.output
    assert (
        "dp=4 tp=1 pp=1 cp=1 ep=2, sharding level 0" in result.output and "note: ep=2: 2 of 4 experts" in result.output
    )
    sharded = CliRunner().invoke(main, [*args, "--sharding-level", "3"], prog_name="optimum-parallel")
    assert sharded.exit_code == 0 and "then / 2 (the dp x cp / ep ranks holding them)" in sharded.output
    bad = CliRunner().invoke(main, [*args, "--sharding-level", "3", "--shard-size", "2"], prog_name="optimum-parallel")
    assert bad.exit_code == 2 and "shard_size=2 (hybrid sharding) with ep=2 is not supported yet" in bad.output
    suggest = ["estimate-memory", str(tmp_path), "--suggest", "--devices", "4", "--memory", "1", "--ep", "2"]
    fixed = CliRunner().invoke(main, suggest, prog_name="optimum-parallel")
    assert fixed.exit_code == 2 and "--suggest chooses --ep itself" in fixed.output
    planner = MemoryPlanner(tiny_config("mixtral", **MOE["mixtral"]))
    workload = Workload(dtype="fp32", seq_len=16)
    between = sum(planner.estimate(Layout(dp=4, ep=ep), workload).total for ep in (1, 2)) / 2 / 1024**3
    args = [*suggest[:-2], "--dtype", "fp32", "--seq-len", "16", "--reserve", "0"]
    args[args.index("--memory") + 1] = f"{between:.9f}"
    result = CliRunner().invoke(main, args, prog_name="optimum-parallel")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    header = next(line.split() for line in lines if line.split()[:1] == ["#"])
    first = next(line.split() for line in lines if line.split()[:1] == ["1"])
    assert header[1:7] == ["dp", "tp", "pp", "cp", "ep", "level"] and first[1:7] == ["4", "1", "1", "1", "2", "0"]
    assert "then fewest ep" in result.output
