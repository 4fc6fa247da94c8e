"""Region ops, parallel layers and the vocab-parallel loss against their single-device versions (gloo, 4 ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _models import rel_err
from torch import nn

TOL = 1e-5


def _tp_group(tp: int):
    import optimum_parallel as op

    return op.init_mesh(dp=dist.get_world_size() // tp, tp=tp).tp_group


def check_vocab_parallel_cross_entropy(vocab: int, tp: int) -> dict:
    from optimum_parallel.tensor_parallel import vocab_parallel_cross_entropy
    from optimum_parallel.tensor_parallel.spec import shard_range

    group = _tp_group(tp)
    torch.manual_seed(0)
    logits = torch.randn(24, vocab) * 3
    target = torch.randint(0, vocab, (24,))
    target[::5] = -100
    target[1] = vocab - 1  # the last id lives on the shortest shard
    full = logits.clone().requires_grad_()
    expected = F.cross_entropy(full, target, ignore_index=-100)
    expected.backward()

    start, end = shard_range(vocab, dist.get_rank(group), tp)
    local = logits[:, start:end].clone().requires_grad_()
    per_token = vocab_parallel_cross_entropy(local, target, group, start)
    loss = per_token.sum() / (target != -100).sum()
    loss.backward()
    return {
        "loss": rel_err(loss, expected),
        "grad": rel_err(local.grad, full.grad[:, start:end]),
        "ignored_zero": bool((per_token[target == -100] == 0).all()),
    }


@pytest.mark.parametrize("vocab,tp", [(128, 2), (130, 4), (7, 4)])
def test_vocab_parallel_cross_entropy(pool, vocab, tp):
    for result in pool.run(check_vocab_parallel_cross_entropy, vocab, tp):
        assert result["loss"] <= TOL and result["grad"] <= TOL and result["ignored_zero"], result


def check_layers(tp: int) -> dict:
    from optimum_parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    group = _tp_group(tp)
    torch.manual_seed(0)
    col, row = nn.Linear(8, 10), nn.Linear(10, 6)  # 10 output features: uneven over 4 ranks
    embedding = nn.Embedding(13, 8, padding_idx=12)
    x = torch.randn(3, 5, 8)
    ids = torch.randint(0, 13, (3, 5))
    ids[0, 0] = 12

    def run(embed, first, second, inputs):
        inputs = inputs.clone().requires_grad_()
        out = second(first(inputs + embed(ids)))
        out.square().sum().backward()
        return out, inputs.grad

    ref_out, ref_grad = run(embedding, col, row, x)
    p_embed = VocabParallelEmbedding.from_embedding(embedding, group)
    p_col = ColumnParallelLinear.from_linear(col, group, gather_output=True)
    p_row = RowParallelLinear.from_linear(row, group, input_is_parallel=False)
    out, grad = run(p_embed, p_col, p_row, x)
    grads = {
        "col.weight": rel_err(p_col.weight.grad, p_col.weight.shard_layout.slice(col.weight.grad)),
        "col.bias": rel_err(p_col.bias.grad, p_col.bias.shard_layout.slice(col.bias.grad)),
        "row.weight": rel_err(p_row.weight.grad, p_row.weight.shard_layout.slice(row.weight.grad)),
        "row.bias": rel_err(p_row.bias.grad, row.bias.grad),
        "embedding": rel_err(p_embed.weight.grad, p_embed.weight.shard_layout.slice(embedding.weight.grad)),
    }
    return {"out": rel_err(out, ref_out), "input_grad": rel_err(grad, ref_grad), **grads}


@pytest.mark.parametrize("tp", [2, 4])
def test_parallel_layers_match_dense(pool, tp):
    for result in pool.run(check_layers, tp):
        assert max(result.values()) <= TOL, result


def check_region_ops(tp: int) -> dict:
    from optimum_parallel.tensor_parallel import (
        gather_from_tensor_parallel_region,
        scatter_to_tensor_parallel_region,
    )
    from optimum_parallel.tensor_parallel.spec import shard_sizes

    group = _tp_group(tp)
    rank = dist.get_rank(group)
    sizes = shard_sizes(11, tp)
    full = torch.arange(2 * 11, dtype=torch.float32).reshape(2, 11)
    local = scatter_to_tensor_parallel_region(full.clone().requires_grad_(), group, sizes=sizes)
    gathered_input = local.detach().clone().requires_grad_()
    gathered = gather_from_tensor_parallel_region(gathered_input, group, sizes=sizes)
    (gathered * (rank + 1)).sum().backward()  # gather's backward keeps this rank's slice of its own gradient
    start = sum(sizes[:rank])
    return {
        "scatter": torch.equal(local, full[:, start : start + sizes[rank]]),
        "gather": torch.equal(gathered, full),
        "gather_backward": torch.equal(gathered_input.grad, torch.full_like(local, rank + 1.0)),
    }


def test_region_ops_uneven(pool):
    for result in pool.run(check_region_ops, 4):
        assert all(result.values()), result
