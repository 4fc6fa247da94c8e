"""Lazy loading (meta build + per-rank safetensors slice reads) and the lazy optimizer, against the real
single-device transformers model (gloo, 2 ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _models import build_model, make_batch, rel_err, tiny_config, whole_logits
from transformers import AutoModelForCausalLM

TOL = 1e-5
LOAD = dict(dtype=torch.float32, attn_implementation="eager")


WORLD_SIZE = 2  # worker processes of this module's `pool` (conftest.py)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A single-file checkpoint (one kv head: replicated over tp=2) and a multi-file tied one (index.json)."""
    root = tmp_path_factory.mktemp("lazy")
    single = tiny_config("llama", num_key_value_heads=1)
    build_model(single, seed=3).save_pretrained(root / "single")
    multi = tiny_config("qwen2", tie_word_embeddings=True, vocab_size=130)
    build_model(multi, seed=4).save_pretrained(root / "multi", max_shard_size="40KB")
    assert (root / "multi" / "model.safetensors.index.json").exists()
    bin_model = build_model(single, seed=5)
    bin_model.config.save_pretrained(root / "bin")
    torch.save(bin_model.state_dict(), root / "bin" / "pytorch_model.bin")
    return {name: str(root / name) for name in ("single", "multi", "bin")}


def check_lazy_matches_eager(path: str) -> dict:
    """Lazy load at tp=2: nothing real before parallelize, each rank reads exactly its shard, and the model
    matches the eagerly loaded single-device one (weights exactly; logits, loss, gradients to fp32 noise)."""
    import optimum_parallel as op
    import optimum_parallel.engine.materialize as lazy

    op.init_mesh(tp=2)
    reference = AutoModelForCausalLM.from_pretrained(path, **LOAD)
    with op.lazy_load_for_parallelism(tensor_parallel_size=2):
        model = AutoModelForCausalLM.from_pretrained(path, **LOAD)
    before = {
        "all_meta": all(p.device.type == "meta" for p in model.parameters()),
        "inv_freq": torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq),
    }
    read, original = [], lazy.read_slice
    lazy.read_slice = lambda *args: read.append(original(*args)) or read[-1]
    try:
        parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
        model = parallelizer.parallelize(model)
    finally:
        lazy.read_slice = original
    ref_params = dict(reference.named_parameters())
    exact = all(
        torch.equal(p, p.shard_layout.slice(ref_params[n]) if hasattr(p, "shard_layout") else ref_params[n])
        for n, p in model.named_parameters()
    )
    batch = make_batch(model.config)
    out, ref_out = model(**batch), reference(**batch)
    out.loss.backward()
    ref_out.loss.backward()
    grads = [
        rel_err(p.grad, p.shard_layout.slice(ref_params[n].grad) if hasattr(p, "shard_layout") else ref_params[n].grad)
        for n, p in model.named_parameters()
    ]
    return {
        **before,
        "exact_weights": exact,
        "elements_read": sum(t.numel() for t in read),
        "local_elements": sum(p.numel() for p in model.parameters()),
        "tied": model.config.tie_word_embeddings == (model.lm_head.weight is model.model.embed_tokens.weight),
        "logits": rel_err(whole_logits(model, out.logits), ref_out.logits),
        "loss": rel_err(out.loss, ref_out.loss),
        "grad": max(grads),
    }


@pytest.mark.parametrize("which", ["single", "multi"])
def test_lazy_load_matches_eager(pool, checkpoints, which):
    for rank, result in enumerate(pool.run(check_lazy_matches_eager, checkpoints[which])):
        assert result["all_meta"] and result["inv_freq"] and result["tied"], (rank, result)
        assert result["exact_weights"], f"rank {rank}: materialised weights differ from the checkpoint's slices"
        assert result["elements_read"] == result["local_elements"], f"rank {rank} read more than its shard: {result}"
        for key in ("logits", "loss", "grad"):
            assert result[key] <= TOL, f"rank {rank}: {key} relative error {result[key]:.2e}"


def check_lazy_from_config() -> dict:
    """Lazy from_config at tp=2: each rank's shards are the slices of one deterministic full init."""
    import optimum_parallel as op
    from optimum_parallel.engine.materialize import materialize_lazy_model

    op.init_mesh(tp=2)
    config = tiny_config("llama", num_key_value_heads=1)
    with op.lazy_load_for_parallelism(tensor_parallel_size=2):
        torch.manual_seed(11)
        full = AutoModelForCausalLM.from_config(config)
        torch.manual_seed(11)
        model = AutoModelForCausalLM.from_config(config)
    meta = all(p.device.type == "meta" for p in model.parameters())
    materialize_lazy_model(full)  # the whole model, as a tp=1 run would get it
    torch.rand(dist.get_rank() + 1)  # ranks' RNGs diverge: the init must not depend on it
    model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(model)
    reference = dict(full.named_parameters())
    same = all(
        torch.equal(p, p.shard_layout.slice(reference[n]) if hasattr(p, "shard_layout") else reference[n])
        for n, p in model.named_parameters()
    )
    weight = reference["model.layers.0.mlp.up_proj.weight"]
    ones = bool((model.model.norm.weight == 1).all())
    return {"meta": meta, "same": same, "std": weight.std().item(), "norm_ones": ones}


def test_lazy_from_config(pool):
    for result in pool.run(check_lazy_from_config):
        assert result["meta"] and result["same"] and result["norm_ones"], result
        assert abs(result["std"] - 0.02) < 0.004, f"init std {result['std']} is not transformers' initializer_range"


def check_lazy_optimizer(path: str, steps: int) -> dict:
    """A lazy AdamW with two param groups becomes the real one over the parallel parameters and trains exactly
    like the single-device AdamW."""
    import optimum_parallel as op

    op.init_mesh(tp=2)
    reference = AutoModelForCausalLM.from_pretrained(path, **LOAD)
    with op.lazy_load_for_parallelism(tensor_parallel_size=2):
        model = AutoModelForCausalLM.from_pretrained(path, **LOAD)

    def groups(m):
        params = list(m.named_parameters())
        return [
            {"params": [p for n, p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for n, p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 5e-3},
        ]

    lazy_adamw = op.make_optimizer_constructor_lazy(torch.optim.AdamW)
    placeholder = lazy_adamw(groups(model), lr=1e-2, betas=(0.9, 0.95))
    untouched = all(p.device.type == "meta" for g in placeholder.param_groups for p in g["params"])
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model)
    optimizer = parallelizer.optimizer_for_mp(placeholder, model.orig_param_to_parallel_param)
    live = {id(p) for p in model.parameters()}
    ref_optimizer = torch.optim.AdamW(groups(reference), lr=1e-2, betas=(0.9, 0.95))
    batch = make_batch(model.config)
    errors = []
    for _ in range(steps):
        loss, ref_loss = model(**batch).loss, reference(**batch).loss
        errors.append(rel_err(loss, ref_loss))
        loss.backward()
        ref_loss.backward()
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    ref_hyper = [{k: v for k, v in g.items() if k != "params"} for g in ref_optimizer.param_groups]
    return {
        "untouched": untouched,
        "type": type(optimizer).__name__,
        "same_hyper": hyper == ref_hyper,
        "on_parallel_params": all(id(p) in live for g in optimizer.param_groups for p in g["params"]),
        "n_params": sum(len(g["params"]) for g in optimizer.param_groups),
        "worst_loss": max(errors),
    }


def test_lazy_optimizer_trains_like_single_device(pool, checkpoints):
    for result in pool.run(check_lazy_optimizer, checkpoints["multi"], 4):
        assert result["untouched"] and result["type"] == "AdamW" and result["same_hyper"], result
        assert result["on_parallel_params"] and result["n_params"] > 0, result
        assert result["worst_loss"] <= TOL, result


def test_sizes_one_is_a_no_op(checkpoints):
    import optimum_parallel as op

    with op.lazy_load_for_parallelism(tensor_parallel_size=1, pipeline_parallel_size=1):
        model = AutoModelForCausalLM.from_pretrained(checkpoints["single"], **LOAD)
    reference = AutoModelForCausalLM.from_pretrained(checkpoints["single"], **LOAD)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))


def test_bin_checkpoint_is_a_clear_error(checkpoints):
    import optimum_parallel as op

    with pytest.raises(ValueError, match=r"pytorch_model\.bin: lazy loading reads slices of safetensors"):
        with op.lazy_load_for_parallelism(tensor_parallel_size=2):
            AutoModelForCausalLM.from_pretrained(checkpoints["bin"], **LOAD)
    # the context restored transformers: the same checkpoint loads eagerly afterwards
    assert AutoModelForCausalLM.from_pretrained(checkpoints["bin"], **LOAD).model.norm.weight.device.type == "cpu"


def test_bad_sizes_are_rejected():
    import optimum_parallel as op

    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        with op.lazy_load_for_parallelism(tensor_parallel_size=0):
            pass
    with pytest.raises(TypeError, match="optimizer class"):
        op.make_optimizer_constructor_lazy("AdamW")


def test_slice_reads_map_contiguous_rows_and_read_the_rest(tmp_path, monkeypatch):
    """read_slice equals the tensor's slice for every layout; dim-0 rows are a copy-on-write mapping of just
    their bytes (writing them never changes the file, the mapping outlives the reader), other slices are read
    (strided rows mapped a bounded block at a time, several ranges)."""
    from safetensors.torch import load_file, save_file

    from optimum_parallel.io import safetensors_io
    from optimum_parallel.io.safetensors_io import SafetensorsReader
    from optimum_parallel.io.slices import read_slice
    from optimum_parallel.tensor_parallel.spec import ShardLayout

    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(6, 10, 3, generator=gen), "b": torch.randn(7, 5, generator=gen).bfloat16()}
    path = tmp_path / "t.safetensors"
    save_file(tensors, path)
    monkeypatch.setattr(safetensors_io, "SLICE_BUFFER", 64)  # force several buffered chunks
    cases = [("a", 0, [(1, 4)]), ("a", 1, [(0, 2), (5, 9)]), ("a", 2, [(2, 3)]), ("b", 1, [(1, 3), (4, 5)])]
    cases += [("b", 0, [(0, 2), (4, 6)]), ("b", 0, [(3, 7)]), ("b", None, [])]
    mapped = []
    original = safetensors_io.map_bytes
    monkeypatch.setattr(safetensors_io, "map_bytes", lambda *args: mapped.append(args[-2:]) or original(*args))
    with SafetensorsReader(path) as reader:
        for key, dim, ranges in cases:
            full = tensors[key]
            layout = ShardLayout(tuple(full.shape), dim, tuple(ranges)) if dim is not None else None
            value = read_slice(reader, key, layout)
            expected = full if dim is None else torch.cat([full.narrow(dim, s, e - s) for s, e in ranges], dim)
            assert torch.equal(value, expected) and value.is_contiguous(), (key, dim, ranges)
        view = read_slice(reader, "a", ShardLayout((6, 10, 3), 0, ((1, 4),)))
    typed = [shape for dtype, shape in mapped if dtype != torch.uint8]
    assert typed == [(3, 10, 3), (4, 5), (7, 5), (3, 10, 3)]  # the single dim-0 ranges and the whole tensor
    blocks = [shape for dtype, shape in mapped if dtype == torch.uint8]  # strided slices: whole rows, mapped a block
    assert blocks and all(rows * width <= 64 or rows == 1 for rows, width in blocks), blocks  # at a time
    monkeypatch.setattr(safetensors_io, "can_map", lambda: False)  # where the OS has no mappings: pread
    with SafetensorsReader(path) as reader:
        for key, dim, ranges in cases[1:5]:
            expected = torch.cat([tensors[key].narrow(dim, s, e - s) for s, e in ranges], dim)
            assert torch.equal(reader.read_slice(key, dim, ranges), expected), (key, dim, ranges)
    view.add_(1.0)  # the reader is closed: the mapping lives on, copy-on-write
    assert torch.equal(view, tensors["a"][1:4] + 1.0)
    assert torch.equal(load_file(path)["a"], tensors["a"])
