"""Expert parallelism for a custom model through Paddle's `parallelize`: the `ExpertParallel` plan style declares an
experts module laid out as no transformers family lays it out (`w13` / `w2` / `w2_bias`, counted by `n_experts`),
and the model trains as one process on the global batch (gloo, 4 ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _models import rel_err
from test_expert_parallel_layouts import replica_mean
from torch import nn
from transformers.modeling_outputs import CausalLMOutput

WORLD_SIZE = 4
VOCAB, HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 96, 32, 24, 4, 2


class StackedExperts(nn.Module):
    """Experts stacked along dim 0 under names of its own: w13 [E, 2I, H] (gate | up), w2 [E, H, I], w2_bias [E, H]."""

    def __init__(self, experts: int = EXPERTS) -> None:
        super().__init__()
        self.n_experts = experts
        self.w13 = nn.Parameter(torch.randn(experts, 2 * INTERMEDIATE, HIDDEN) * 0.2)
        self.w2 = nn.Parameter(torch.randn(experts, HIDDEN, INTERMEDIATE) * 0.2)
        self.w2_bias = nn.Parameter(torch.randn(experts, HIDDEN) * 0.1)

    def forward(self, rows: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(rows)
        for expert in range(self.n_experts):
            row, slot = torch.where(top_k_index == expert)
            gate, up = (rows[row] @ self.w13[expert].T).chunk(2, dim=-1)
            down = (F.silu(gate) * up) @ self.w2[expert].T + self.w2_bias[expert]
            out = out.index_add(0, row, down * top_k_weights[row, slot, None])
        return out


class Block(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.router = nn.Linear(HIDDEN, experts, bias=False)
        self.moe = StackedExperts(experts)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = self.norm(hidden).reshape(-1, HIDDEN)
        weights, index = self.router(rows).softmax(-1).topk(TOP_K, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return hidden + self.moe(rows, index, weights).view_as(hidden)


class TinyMoE(nn.Module):
    """A language model of two MoE blocks; its loss is the mean over labelled tokens."""

    def __init__(self, experts: int = EXPERTS) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block(experts) for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **_) -> CausalLMOutput:
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = block(hidden)
        logits = self.head(hidden)
        loss = None if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)


def build(experts: int = EXPERTS) -> TinyMoE:
    torch.manual_seed(0)
    return TinyMoE(experts)


def replica_batch(replicas: int, seq: int = 12) -> dict[str, torch.Tensor]:
    """2 rows per replica, the first left-padded (-100 labels), one more -100 column: as many labelled tokens in
    every replica, so the mean of the replicas' losses is the global batch's."""
    input_ids = torch.randint(0, VOCAB, (2 * replicas, seq), generator=torch.Generator().manual_seed(3))
    labels = input_ids.clone()
    labels[0::2, :3] = -100
    labels[:, seq // 2] = -100
    return {"input_ids": input_ids, "labels": labels}


def plan(tp: int) -> dict:
    import optimum_parallel as op

    declare = op.ExpertParallel(("w13", "w2", "w2_bias"), num_experts="n_experts")
    styles = [op.TensorParallelExperts(packed=("w13",), row=("w2",)), declare] if tp > 1 else declare
    return {"blocks.*.moe": styles}


def check_training(sizes: dict, level: int, steps: int = 3) -> dict:
    import optimum_parallel as op
    from optimum_parallel.engine.grad_norm import grad_norm
    from optimum_parallel.expert_parallel import expert_layout

    mesh = op.init_mesh(**sizes)
    reference = build()
    model = copy.deepcopy(reference)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    config = {"dp_config": {"sharding_level": level}, "mp_config": {"parallelize_plan": plan(mesh.tp_size)}}
    model, optimizer = op.parallelize(model, optimizer, mesh, config)

    replicas, replica = mesh.data_parallel_size, mesh.data_parallel_rank
    batch = replica_batch(replicas)
    local = {k: v[2 * replica : 2 * replica + 2] for k, v in batch.items()}
    ref_params = dict(reference.named_parameters())

    def whole(param):  # FSDP2 shards (levels 2-3) gathered back for the comparison
        return param.full_tensor() if hasattr(param, "full_tensor") else param

    errors, losses = {}, []
    for step in range(steps + 1):
        if step:
            ref_optimizer.step()
            optimizer.step()
            ref_optimizer.zero_grad()
            optimizer.zero_grad()
        ref_loss = reference(**batch).loss
        ref_loss.backward()
        loss = model(**local).loss
        loss.backward()
        losses.append(rel_err(replica_mean(loss, mesh), ref_loss))
        if step == 0:
            for name, param in model.named_parameters():
                expected = ref_params[name].grad
                for layout in (expert_layout(param), getattr(param, "shard_layout", None)):
                    if layout is not None:
                        expected = layout.slice(expected)
                errors[name] = rel_err(whole(param.grad), expected)
            ref_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
            errors["grad_norm"] = rel_err(grad_norm(model), ref_norm)
    errors["loss"], errors["steps"] = losses[0], max(losses[1:])
    held = {name: whole(p).shape[0] for name, p in model.named_parameters() if name.endswith(("w13", "w2"))}
    counts = {m.n_experts for m in model.modules() if isinstance(m, StackedExperts)}
    return {"errors": errors, "held": held, "counts": counts}


CASES = [(dict(dp=4, ep=2), 0), (dict(dp=4, ep=2), 1), (dict(dp=4, ep=2), 2), (dict(dp=2, tp=2, ep=2), 0)]


@pytest.mark.parametrize("sizes,level", CASES, ids=[f"{s}-level{lvl}" for s, lvl in CASES])
def test_custom_experts_train_as_one_process(pool, sizes, level):
    for rank, result in enumerate(pool.run(check_training, sizes, level)):
        worst = {k: v for k, v in result["errors"].items() if v > 1e-5}
        assert not worst, f"rank {rank}: {worst}"
        assert len(result["errors"]) > 10  # every parameter's gradient was compared
        assert result["held"] and set(result["held"].values()) == {EXPERTS // sizes["ep"]}, result["held"]
        assert result["counts"] == {EXPERTS // sizes["ep"]}  # the declared counter now counts local experts


def check_refusals() -> dict:
    from _checks import error_and_whether_untouched

    import optimum_parallel as op

    mesh = op.init_mesh(dp=4, ep=4)
    out = {}
    level0 = {"dp_config": {"sharding_level": 0}}
    undeclared = build()
    out["undeclared"] = error_and_whether_untouched(undeclared, lambda: op.parallelize(undeclared, None, mesh, level0))
    cases = {
        "bad_tensor": op.ExpertParallel(("w13", "w3")),
        "bad_counter": op.ExpertParallel(("w13", "w2"), num_experts="num_experts"),
        "mixed_counts": op.ExpertParallel(("w13", "w2", "w13_extra")),
    }
    for key, style in cases.items():
        model = build()
        for block in model.blocks:
            block.moe.w13_extra = nn.Parameter(torch.zeros(EXPERTS + 1, 2))
        config = {**level0, "mp_config": {"parallelize_plan": {"blocks.*.moe": style}}}
        out[key] = error_and_whether_untouched(model, lambda m=model, c=config: op.parallelize(m, None, mesh, c))
    six = build(experts=6)
    config = {**level0, "mp_config": {"parallelize_plan": {"blocks.*.moe": op.ExpertParallel(("w13", "w2"))}}}
    out["indivisible"] = error_and_whether_untouched(six, lambda: op.parallelize(six, None, mesh, config))
    try:
        op.ExpertParallel("w13")
    except ValueError as err:
        out["string"] = str(err)
    return out


def test_refusals_name_the_style_and_the_allowed_values(pool):
    for result in pool.run(check_refusals):
        for key in ("undeclared", "bad_tensor", "bad_counter", "mixed_counts", "indivisible"):
            kind, message, untouched = result[key]
            assert kind == "ValueError" and untouched, (key, result[key])
        assert "ExpertParallel style" in result["undeclared"][1] and "ep=1" in result["undeclared"][1]
        assert "'w3'" in result["bad_tensor"][1] and "allowed: its own parameters" in result["bad_tensor"][1]
        assert "num_experts='num_experts'" in result["bad_counter"][1] and "allowed" in result["bad_counter"][1]
        assert "disagree on the number of experts" in result["mixed_counts"][1]
        assert (
            "ep=4 does not divide the 6 experts" in result["indivisible"][1]
            and "allowed: divisors of 6 that divide dp x cp (1, 2, 3, 6)" in (result["indivisible"][1])
        )
        assert "non-empty sequence" in result["string"]
