"""Plan files: a dry run on one process writes the same file as the really parallelized model on gloo ranks; a
loaded plan parallelizes a model exactly like the family's plan; a file that does not fit names its first
mismatching entry."""

from __future__ import annotations

import copy
import json

import pytest
import torch.distributed as dist
from _models import rel_err
from test_families import family_config, load_model, make_inputs, save_tiny_model

import optimum_parallel as op
from optimum_parallel.memory_planner.plan_files import (
    STYLES,
    check_plan_fits,
    load_plan,
    plan_file_parallelizer,
    read_plan_file,
    save_plan,
    style_from_dict,
    style_to_dict,
)
from optimum_parallel.memory_planner.simulate import build_meta_model
from optimum_parallel.tensor_parallel.spec import ShardLayout, ShardSpec

# (family, task, tp, config overrides, sequence parallel): head splits, kv heads replicated over tp, packed qkv,
# Conv1D, tied MLM bias, experts, sequence-parallel markers
CASES = [
    ("llama", "causal", 2, {"tie_word_embeddings": True, "vocab_size": 130}, False),
    ("llama", "causal", 2, {}, True),
    ("phi3", "causal", 4, {"vocab_size": 130, "tie_word_embeddings": True}, False),
    ("gpt2", "causal", 2, {}, False),
    ("bert", "mlm", 2, {}, False),
    ("mixtral", "causal", 2, {}, False),
]


def saved_on_ranks(model_dir: str, task: str, tp: int, path: str, sp: bool) -> dict:
    """Parallelize the real model with its family's plan and save its plan (every rank calls save_plan)."""
    mesh = op.init_mesh(dp=dist.get_world_size() // tp, tp=tp)
    model = load_model(model_dir, task)
    model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(model, sequence_parallel_enabled=sp)
    doc = save_plan(model, path, sequence_parallel_enabled=sp)
    local = {n: p.shard_layout for n, p in model.named_parameters() if getattr(p, "shard_layout", None) is not None}
    return {"doc": doc, "tp_rank": mesh.tp_rank, "layouts": local}


@pytest.mark.parametrize("family,task,tp,overrides,sp", CASES, ids=[f"{c[0]}-tp{c[2]}{'-sp' * c[4]}" for c in CASES])
def test_dry_run_writes_the_file_of_the_parallelized_model(pool, tmp_path, family, task, tp, overrides, sp):
    model_dir = save_tiny_model(tmp_path / family, family_config(family, **overrides), task)
    dry = save_plan(model_dir, tmp_path / "dry.json", tp=tp, dp=4 // tp, sequence_parallel_enabled=sp)
    assert not dist.is_initialized(), "a dry run needs no process group"
    results = pool.run(saved_on_ranks, model_dir, task, tp, str(tmp_path / "real.json"), sp)
    real = json.loads((tmp_path / "real.json").read_text())
    assert real == dry == results[0]["doc"]
    for result in results:  # the file's ranges are every rank's actual layout
        for name, layout in result["layouts"].items():
            entry = real["params"][name]
            if layout.dim is None:  # a replicated layout (a row-parallel bias)
                assert entry["dim"] is None and "ranks" not in entry, name
                continue
            assert ShardLayout.from_json({**entry, **entry["ranks"][result["tp_rank"]]}) == layout
            assert ShardSpec.from_json(entry) == layout.spec  # the head counts too
    assert any(entry["dim"] is None for entry in real["params"].values())  # replicated ones are listed too
    if sp:
        assert any(s["style"] == "SequenceParallelEnable" for styles in real["modules"].values() for s in styles)


def save_with_other_flags(model_dir: str, path: str) -> str:
    """Parallelized without the embeddings, saved with the default (embeddings split): every rank must raise."""
    op.init_mesh(dp=2, tp=2)
    model = load_model(model_dir, "causal")
    model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(model, parallelize_embeddings=False)
    try:
        save_plan(model, path)
    except ValueError as err:
        return str(err)
    return "saved"


def test_saving_with_other_flags_than_the_model_raises_everywhere(pool, tmp_path):
    model_dir = save_tiny_model(tmp_path / "llama", family_config("llama"), "causal")
    messages = pool.run(save_with_other_flags, model_dir, str(tmp_path / "plan.json"))
    assert len(set(messages)) == 1 and not (tmp_path / "plan.json").exists()
    assert messages[0].startswith("parameter 'model.embed_tokens.weight' on tp rank 0 is not split, but the plan ")


def parallelize_three_ways(model_dir: str, task: str, tp: int, path: str, with_api: bool) -> dict:
    """The family's parallelizer, the plan file's parallelizer and op.parallelize with the loaded plan: losses."""
    op.init_mesh(dp=dist.get_world_size() // tp, tp=tp)
    reference = load_model(model_dir, task)
    batch = make_inputs(reference.config, task)
    expected = reference(**batch).loss
    family = op.ParallelizersManager.parallelizer_for_model(reference).parallelize(copy.deepcopy(reference))
    from_file = plan_file_parallelizer(path).parallelize(copy.deepcopy(reference))
    losses = {"family": family(**batch).loss, "file": from_file(**batch).loss, "api": expected}
    if with_api:  # op.parallelize runs no family after_plan: only where the local head counts need no fixing
        model = copy.deepcopy(reference)
        plan = load_plan(path, model=model)
        via_api, _ = op.parallelize(model, config={"mp_config": {"parallelize_plan": plan}})
        losses["api"] = via_api(**batch).loss
    layouts = {n: getattr(p, "shard_layout", None) for n, p in from_file.named_parameters()}
    same_layouts = all(getattr(p, "shard_layout", None) == layouts[n] for n, p in family.named_parameters())
    return {
        "file_vs_family": (losses["file"] - losses["family"]).abs().item(),
        "file_vs_reference": rel_err(losses["file"], expected),
        "api_vs_reference": rel_err(losses["api"], expected),
        "same_layouts": same_layouts,
    }


def test_a_loaded_plan_parallelizes_like_the_family(pool, tmp_path):
    # 4 query heads, 2 kv heads over tp=4: the kv heads are replicated and the family's after_plan must run
    # (the plan-file parallelizer keeps it); op.parallelize with the loaded plan has tp=2 here (no after_plan)
    model_dir = save_tiny_model(tmp_path / "llama", family_config("llama", vocab_size=130), "causal")
    for tp in (4, 2):
        path = tmp_path / f"tp{tp}.json"
        save_plan(model_dir, path, tp=tp)
        for result in pool.run(parallelize_three_ways, model_dir, "causal", tp, str(path), tp == 2):
            assert result["same_layouts"] and result["file_vs_family"] == 0.0, result
            assert result["file_vs_reference"] <= 1e-5, result
            assert result["api_vs_reference"] <= 1e-5, result


# --------------------------------------------------------------------------------------------------------------
# One process: what does not fit, and the styles' round trip


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plans") / "llama-tp2.json"
    save_plan(family_config("llama"), path, tp=2)
    return path


def _meta(**overrides):
    return build_meta_model(family_config("llama", **overrides))


def test_load_plan_keys_are_exact_module_names(llama_file):
    plan = load_plan(llama_file, model=_meta())
    assert plan[r"model\.layers\.1\.self_attn\.k_proj"][0].units == 2
    assert isinstance(plan["lm_head"][0], op.ColWiseParallel)
    doc = read_plan_file(llama_file)
    assert doc["mesh"] == {"dp": 1, "pp": 1, "cp": 1, "tp": 2} and doc["parallelizer"] == "LlamaParallelizer"


def test_mesh_sizes_record_cp_and_files_without_cp_still_load(tmp_path):
    doc = save_plan(family_config("llama"), tmp_path / "cp.json", tp=2, dp=2, cp=2)
    assert doc["mesh"] == {"dp": 2, "pp": 1, "cp": 2, "tp": 2}
    before_cp = {**doc, "mesh": {"dp": 2, "pp": 1, "tp": 2}}  # a file written before the cp dim existed
    assert load_plan(before_cp, model=_meta(), tp=2).keys() == load_plan(doc, model=_meta(), tp=2).keys()


def test_mismatches_name_the_first_entry(llama_file, tmp_path):
    with pytest.raises(ValueError, match=r"entry mesh.tp: the file was made for tp=2, the mesh has tp=4"):
        load_plan(llama_file, model=_meta(), tp=4)
    with pytest.raises(ValueError, match=r"params: the model's parameter 'model.layers.2.self_attn.q_proj.weight'"):
        check_plan_fits(_meta(num_hidden_layers=3), llama_file)
    with pytest.raises(ValueError, match=r"modules\['model.layers.1.self_attn.q_proj'\]: .* has no module"):
        check_plan_fits(_meta(num_hidden_layers=1), llama_file)
    with pytest.raises(ValueError, match=r"params\['model.embed_tokens.weight'\]: shape \[128, 64\] in the file"):
        check_plan_fits(_meta(vocab_size=130), llama_file)
    with pytest.raises(ValueError, match=r"entry model_type: the file is for 'llama', the model is 'qwen2'"):
        check_plan_fits(build_meta_model(family_config("qwen2")), llama_file)
    doc = json.loads(llama_file.read_text())
    doc["params"]["model.layers.0.mlp.up_proj.weight"]["ranks"][1]["ranges"] = [[40, 96]]
    with pytest.raises(ValueError, match=r"params\['model.layers.0.mlp.up_proj.weight'\]: split .* its styles give"):
        check_plan_fits(_meta(), doc)
    doc = json.loads(llama_file.read_text())
    doc["modules"]["model.layers.0.mlp.up_proj"] = [{"style": "RowWiseParallel", "args": {"units": 3}}]
    with pytest.raises(ValueError, match=r"plan file styles do not fit .*3 heads cannot be split"):
        check_plan_fits(_meta(), doc)


def _as_version_1(doc: dict) -> dict:
    """`doc` as version 1 wrote it: {"shape", "split": null | {"dim", "replicas", "ranges": per tp rank}}."""
    params = {}
    for name, entry in doc["params"].items():
        split = None
        if entry["dim"] is not None:
            ranks = entry["ranks"]
            split = {"dim": entry["dim"], "replicas": ranks[0]["replicas"], "ranges": [r["ranges"] for r in ranks]}
        params[name] = {"shape": entry["global_shape"], "split": split}
    return {**doc, "version": 1, "params": params}


def test_version_1_files_still_load_and_are_checked(llama_file):
    doc = json.loads(llama_file.read_text())
    old = _as_version_1(doc)
    assert load_plan(old, model=_meta()).keys() == load_plan(doc, model=_meta()).keys()
    old["params"]["model.layers.0.mlp.up_proj.weight"]["split"]["ranges"][1] = [[40, 96]]
    with pytest.raises(ValueError, match=r"params\['model.layers.0.mlp.up_proj.weight'\]: split .* its styles give"):
        check_plan_fits(_meta(), old)
    old["params"]["model.embed_tokens.weight"]["shape"] = [130, 64]
    with pytest.raises(ValueError, match=r"params\['model.embed_tokens.weight'\]: shape \[130, 64\] in the file"):
        check_plan_fits(_meta(), old)


def test_not_a_plan_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a plan file \\(invalid JSON"):
        load_plan(bad)
    bad.write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match='not a plan file \\(no "format": "optimum-parallel-plan"\\)'):
        load_plan(bad)
    bad.write_text('{"format": "optimum-parallel-plan", "version": 9}')
    with pytest.raises(ValueError, match="plan file version 9; this version reads 1, 2"):
        load_plan(bad)


def test_custom_function_styles_are_kept_by_name_but_not_reloadable(tmp_path):
    model = _meta()
    plan = {
        r"model\.layers\.\d+\.mlp\.(gate|up)_proj": op.ColWiseParallel(),
        "model.norm": [op.PrepareLayerInput(print)],
    }
    path = tmp_path / "custom.json"
    doc = save_plan(model, path, plan, tp=2)
    assert doc["parallelizer"] is None
    assert doc["modules"]["model.norm"] == [
        {"style": "PrepareLayerInput", "args": {"fn": repr(print)}, "reloadable": False}
    ]
    with pytest.raises(ValueError, match=r"modules\['model.norm'\]\[0\]: style PrepareLayerInput .* cannot be rebuilt"):
        load_plan(path)
    with pytest.warns(UserWarning, match="left out \\(not reloadable\\): model.norm: PrepareLayerInput"):
        loaded = load_plan(path, skip_unreloadable=True)
    assert "model\\.norm" not in loaded and len(loaded) == 4
    doc["modules"]["model.norm"] = [{"style": "NoSuchStyle", "args": {}}]
    with pytest.raises(ValueError, match="unknown style 'NoSuchStyle'; known: "):
        load_plan(doc)


SAMPLE_ARGS = {
    "PackedColWiseParallel": dict(parts=[64, 32, 32], units=[4, 2, 2]),
    "TensorParallelExperts": dict(packed=["gate_up_proj"], row=["down_proj"]),
    "TiedBiasColWiseParallel": dict(child="decoder", bias="bias", gather_output=True),
    "SequenceParallelBegin": dict(on="input"),
    "SplitParameter": dict(param="sinks", units=4),
    "ColWiseParallel": dict(gather_output=True, units=8),
    "LatentKeyValueProjection": dict(rope_dim=8),
    "SequenceParallelSplitArgument": dict(argument="per_layer_input"),
}


@pytest.mark.parametrize("name", sorted(n for n in STYLES if n not in ("PrepareLayerInput", "PrepareLayerOutput")))
def test_every_style_round_trips_through_json(name):
    style = STYLES[name](**SAMPLE_ARGS.get(name, {}))
    entry = json.loads(json.dumps(style_to_dict(style)))
    assert entry.get("reloadable", True), entry
    rebuilt = style_from_dict(entry, "test")
    assert type(rebuilt) is type(style) and style_to_dict(rebuilt) == entry


def test_style_json_names_still_import_from_plan_files():
    from optimum_parallel.memory_planner import plan_files, style_json

    for name in ("STYLES", "register_style", "style_from_dict", "style_to_dict"):
        assert getattr(plan_files, name) is getattr(style_json, name), name
