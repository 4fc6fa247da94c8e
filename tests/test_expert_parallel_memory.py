"""The memory planner with expert parallelism: per-rank parameter, gradient and AdamW bytes of a tiny MoE checked
against the model actually parallelized (gloo, 4 ranks: dp=4 x ep=2 / ep=4, dp=2 x tp=2 x ep=2), ep in
`--suggest`, and the refusals."""

from __future__ import annotations

import pytest
import torch
from _checks import train_step
from _models import build_model, tiny_config
from test_expert_parallel import MOE, replica_batch

from optimum_parallel.planning.memory_planner import MemoryPlanner
from optimum_parallel.planning.workload import Layout, Workload

WORLD_SIZE = 4
FP32 = Workload(dtype="fp32", seq_len=16, micro_batch=2)


def held_bytes(model_type: str, sizes: dict) -> dict:
    """Bytes of this rank's parameters, gradients and AdamW state after one step of the parallelized model."""
    import optimum_parallel as op

    mesh = op.init_mesh(**sizes)
    model = build_model(tiny_config(model_type, **MOE[model_type]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if mesh.tp_size > 1:
        parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
        model = parallelizer.parallelize(model)
        optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
    model, optimizer = op.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": 0}})
    batch = replica_batch(model.config, mesh.data_parallel_size)
    replica = mesh.data_parallel_rank
    local = {k: v[2 * replica : 2 * replica + 2] for k, v in batch.items()}
    loss = model(**local).loss
    loss.backward()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    optimizer.step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values())
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    train_step(model, optimizer, local)
    return {"params": params, "grads": grads, "state": state, "experts": experts}


CASES = [
    ("mixtral", dict(dp=4, ep=2)),
    ("mixtral", dict(dp=4, ep=4)),
    ("mixtral", dict(dp=2, tp=2, ep=2)),
    ("qwen3_moe", dict(dp=2, tp=2, ep=2)),
]


@pytest.mark.parametrize("model_type,sizes", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_estimate_matches_the_parallelized_model(pool, model_type, sizes):
    held = pool.run(held_bytes, model_type, sizes)
    planner = MemoryPlanner(tiny_config(model_type, **MOE[model_type]))
    layout = Layout(dp=sizes["dp"], tp=sizes.get("tp", 1), ep=sizes["ep"])
    estimate = planner.estimate(layout, FP32)
    assert estimate.parameters == max(h["params"] for h in held)
    assert estimate.gradients == max(h["grads"] for h in held)
    assert estimate.optimizer_state == max(h["state"] for h in held)
    plain = planner.estimate(Layout(dp=sizes["dp"], tp=sizes.get("tp", 1)), FP32)
    # only the expert tensors shrink, by ep
    counts = planner.counts(layout.tp, 1, layout.ep)
    assert counts.experts * 4 == max(h["experts"] for h in held)
    assert plain.parameters - estimate.parameters == counts.experts * 4 * (sizes["ep"] - 1)
    assert estimate.activations > plain.activations  # the dispatched rows
    assert any(f"ep={sizes['ep']}" in note for note in estimate.notes)


def test_suggest_proposes_ep_when_only_split_experts_fit():
    planner = MemoryPlanner(tiny_config("mixtral", **MOE["mixtral"]))
    by_ep = {ep: planner.estimate(Layout(dp=4, ep=ep), FP32).total for ep in (1, 2, 4)}
    assert by_ep[4] < by_ep[2] < by_ep[1]
    roomy = planner.suggest(4, by_ep[1] * 2, FP32, reserve=0)
    assert (roomy[0].layout.ep, roomy[0].layout.tp, roomy[0].layout.sharding_level) == (1, 1, 0)
    assert any(e.layout.ep == 2 for e in roomy) and any(e.layout.ep == 4 for e in roomy)
    tight = planner.suggest(4, (by_ep[2] + by_ep[1]) / 2, FP32, reserve=0)
    assert tight and tight[0].layout.ep == 2 and tight[0].layout.tp == 1 and tight[0].layout.sharding_level == 0
    assert all(e.layout.ep == 1 or (e.layout.sharding_level == 0 and e.layout.pp == 1) for e in roomy)
    dense = MemoryPlanner(tiny_config("llama"))
    assert all(e.layout.ep == 1 for e in dense.suggest(4, by_ep[1] * 2, FP32))


def test_refusals_name_the_key_and_the_allowed_values():
    with pytest.raises(ValueError, match=r"ep=3 must divide dp x cp = 4; allowed: 1, 2, 4"):
        Layout(dp=4, ep=3)
    with pytest.raises(ValueError, match=r"sharding_level=2 with ep=2 is not supported yet; allowed with ep > 1: "):
        Layout(dp=4, ep=2, sharding_level=2)
    with pytest.raises(ValueError, match=r"pp=2 with ep=2 .* allowed with ep > 1: pp=1"):
        Layout(dp=2, pp=2, ep=2)
    with pytest.raises(ValueError, match=r"ep=8 must divide .* experts of every MoE block \[4\]; allowed: 1, 2, 4"):
        MemoryPlanner(tiny_config("mixtral", **MOE["mixtral"])).estimate(Layout(dp=8, ep=8), FP32)
    with pytest.raises(ValueError, match=r"ep=2: the model has no stacked experts module to split; allowed: ep=1"):
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
    bad = CliRunner().invoke(main, [*args, "--sharding-level", "1"], prog_name="optimum-parallel")
    assert bad.exit_code == 2 and "sharding_level=1 with ep=2 is not supported yet" in bad.output
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
