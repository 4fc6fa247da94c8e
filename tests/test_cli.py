"""The `optimum-parallel` command line, run as a user would (subprocesses, torchrun for the demo)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from _models import LLAMA_70B, TINY
from transformers import AutoConfig, LlamaConfig

CLI = [sys.executable, "-m", "optimum_parallel.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=ENV)


def test_help_lists_commands():
    result = run("--help")
    assert result.returncode == 0 and "demo" in result.stdout


def test_demo_matches_single_process(tmp_path):
    result = run("demo", "--steps", "6", "--output-dir", str(tmp_path / "ckpt"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "loss tp=2" in result.stdout and "max |loss difference|" in result.stdout
    assert (tmp_path / "ckpt" / "config.json").exists() and (tmp_path / "ckpt" / "model.safetensors").exists()


def test_bad_option_is_a_one_line_error():
    result = run("demo", "--tp", "two")
    assert result.returncode == 2 and "Invalid value for '--tp'" in result.stderr


# ----------------------------------------------------------------------------------------------------------------
# Every subcommand: --help, bad arguments (exit 2, one line), failures (exit 1, one line); plan and estimate-memory

COMMANDS = ("demo", "plan", "estimate-memory", "consolidate", "reshard", "inspect")


def cli(*args: str) -> tuple[int, str, str]:
    """Run the command line in this process (click's runner): exit code, stdout, stderr."""
    from click.testing import CliRunner

    from optimum_parallel.cli import main

    result = CliRunner().invoke(main, list(args), prog_name="optimum-parallel")
    return result.exit_code, result.stdout, result.stderr


def one_line_error(err: str) -> bool:
    return err.startswith("Error: ") and err.strip().count("\n") == 0 and "Traceback" not in err


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny Llama's config.json (plan and estimate-memory read nothing else)."""
    directory = tmp_path_factory.mktemp("llama")
    LlamaConfig(**LLAMA).save_pretrained(directory)
    return str(directory)


LLAMA = {**TINY, "vocab_size": 130}  # 130 splits unevenly over tp=2


def test_group_help_lists_every_subcommand():
    code, out, _ = cli("--help")
    assert code == 0 and all(command in out for command in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_has_help(command):
    code, out, err = cli(command, "--help")
    assert code == 0, err
    assert out.startswith(f"Usage: optimum-parallel {command} ") and "--help" in out


BAD_ARGUMENTS = [
    (("nosuch",), "No such command 'nosuch'"),
    (("demo", "--tp", "two"), "Invalid value for '--tp'"),
    (("plan", "{model}"), "Missing option '--tp'"),
    (("plan", "{model}", "--tp", "0"), "Invalid value for '--tp': 0 is not in the range x>=1"),
    (("plan", "{model}", "--tp", "3"), "tensor_parallel_size=3 must divide num_attention_heads=4"),
    (("plan", "/no/such/dir", "--tp", "2"), "Invalid value for 'MODEL': Path '/no/such/dir' does not exist"),
    (("plan", "{empty}", "--tp", "2"), "Invalid value for MODEL: no config.json in directory"),
    (("plan", "{model}", "--tp", "2", "--dtype", "int8"), "Invalid value for '--dtype': 'int8' is not one of"),
    (("estimate-memory", "{model}", "--sharding-level", "4"), "Invalid value for '--sharding-level'"),
    (("estimate-memory", "{model}", "--pp", "3"), "2 layers cannot be split into 3 pipeline stages"),
    (("estimate-memory", "{model}", "--seq-len", "0"), "Invalid value for '--seq-len'"),
    (("estimate-memory", "{model}", "--pp", "2", "--num-microbatches", "1"), "num_microbatches=1 is not allowed"),
    (("estimate-memory", "{model}", "--suggest", "--devices", "4"), "--suggest needs --memory"),
    (("estimate-memory", "{model}", "--suggest", "--memory", "8"), "--suggest needs --devices"),
    (("estimate-memory", "{model}", "--suggest", "--devices", "4", "--memory", "8", "--tp", "2"), "chooses --tp"),
    (("estimate-memory", "{model}", "--devices", "4"), "--devices only apply with --suggest"),
    (("estimate-memory", "{model}", "--suggest", "--devices", "4", "--memory", "8", "--cp", "2"), "chooses --cp"),
    (("estimate-memory", "{model}", "--cp", "0"), "--cp"),
    (("estimate-memory", "{model}", "--memory", "-1"), "Invalid value for '--memory'"),
    (("estimate-memory", "{bad_json}"), "cannot read a transformers config from"),
    (("plan", "{empty}/../bad.json", "--tp", "2"), "is not a valid JSON file"),
    (("consolidate", "{empty}"), "Missing argument 'OUTPUT'"),
    (("reshard", "{empty}", "{empty}/out"), "Missing option '--tp'"),
    (("reshard", "{empty}", "{empty}/out", "--tp", "2", "--pp", "0"), "Invalid value for '--pp'"),
    (("inspect",), "Missing argument 'CHECKPOINT'"),
    (("inspect", "/no/such/ckpt"), "'/no/such/ckpt' does not exist"),
]


@pytest.fixture
def paths(model_dir, tmp_path) -> dict[str, str]:
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.json").write_text("{not json")
    return {"model": model_dir, "empty": str(tmp_path / "empty"), "bad_json": str(tmp_path / "bad.json")}


@pytest.mark.parametrize(
    "args,message", BAD_ARGUMENTS, ids=[" ".join(a[:2]) + f"-{i}" for i, (a, _) in enumerate(BAD_ARGUMENTS)]
)
def test_bad_arguments_are_one_line_errors_with_exit_code_2(paths, args, message):
    code, out, err = cli(*(a.format(**paths) for a in args))
    assert code == 2 and one_line_error(err) and message in err, (code, out, err)
    assert "--help" in err  # where to look


def test_failures_are_one_line_errors_with_exit_code_1(paths, tmp_path):
    empty = paths["empty"]
    for args in (("inspect", empty), ("consolidate", empty, f"{tmp_path}/out"), ("reshard", empty, "o", "--tp", "2")):
        code, _, err = cli(*args)
        assert code == 1 and one_line_error(err) and "is not a sharded checkpoint" in err, (args, err)
    bloom = tmp_path / "bloom"
    AutoConfig.for_model("bloom").save_pretrained(bloom)
    code, _, err = cli("plan", str(bloom), "--tp", "2")
    assert code == 1 and one_line_error(err) and "model type 'bloom' is not supported" in err, err
    code, out, err = cli("estimate-memory", paths["model"], "--suggest", "--devices", "2", "--memory", "0.00001")
    assert code == 1 and one_line_error(err) and "no layout of 2 devices fits" in err and "0 layouts fit" in out


def test_plan_prints_the_split_table_and_saves_a_plan_file(model_dir, tmp_path):
    from optimum_parallel.memory_planner.plan_files import load_plan
    from optimum_parallel.memory_planner.simulate import build_meta_model

    code, out, err = cli("plan", model_dir, "--tp", "2", "--save", str(tmp_path / "plan.json"))
    assert code == 0, err
    assert "LlamaForCausalLM (llama), tp=2, parallelizer LlamaParallelizer" in out
    assert "model.layers.*.self_attn.q_proj.weight" in out and "ColWiseParallel(units=4)" in out
    assert "lm_head.weight" in out and "dim 0: [0, 65) of 130" in out  # vocab 130 split unevenly
    assert f"wrote plan file {tmp_path / 'plan.json'}" in out
    plan = load_plan(tmp_path / "plan.json", model=build_meta_model(LlamaConfig(**LLAMA)), tp=2)
    assert plan[r"model\.layers\.0\.self_attn\.k_proj"][0].units == 2
    code, out_json, _ = cli("plan", f"{model_dir}/config.json", "--tp", "2")  # a config.json path works too
    assert code == 0 and out_json == out.replace(f"wrote plan file {tmp_path / 'plan.json'}\n", "")


def test_estimate_memory_prints_both_sequence_parallel_columns(model_dir):
    from optimum_parallel.memory_planner.estimate import MemoryPlanner
    from optimum_parallel.memory_planner.memory_text import in_unit, pick_unit
    from optimum_parallel.memory_planner.workload import Layout, Workload

    args = ["--tp", "2", "--dp", "2", "--sharding-level", "1", "--seq-len", "64", "--micro-batch", "2"]
    code, out, err = cli("estimate-memory", model_dir, *args)
    assert code == 0, err
    assert "layout: dp=2 tp=2 pp=1 cp=1, sharding level 1" in out and "SP off" in out and "SP on" in out
    planner, workload = MemoryPlanner(LlamaConfig(**LLAMA)), Workload(seq_len=64, micro_batch=2)
    off, on = (planner.estimate(Layout(2, 2, 1, 1, sp), workload) for sp in (False, True))
    total = next(line for line in out.splitlines() if line.startswith("total"))
    unit, scale = pick_unit(off.total)
    assert unit != "GiB" and f"{unit} on the rank with the most" in out  # a tiny model: not 0.00 GiB
    assert total.split()[1:] == [in_unit(off.total, scale), in_unit(on.total, scale)]
    assert "activations, Korthikanti et al. 2022" in out and "activations, Llama count" in out
    code, out, _ = cli("estimate-memory", model_dir, "--cp", "2", "--seq-len", "64")
    assert code == 0 and "layout: dp=1 tp=1 pp=1 cp=2, sharding level 0" in out and "ring attention" in out
    code, out, _ = cli("estimate-memory", model_dir, "--pp", "2", "--dtype", "fp32", "--activations", "paper")
    assert code == 0 and "activations (Korthikanti et al. 2022)" in out and "1F1B" in out
    code, out, _ = cli("estimate-memory", model_dir, "--pp", "2", "--num-microbatches", "4", "--schedule", "gpipe")
    assert code == 0 and "GPipe, every stage keeps all 4 micro-batches" in out


def test_estimate_memory_suggests_layouts_best_first(model_dir):
    code, out, err = cli("estimate-memory", model_dir, "--suggest", "--devices", "4", "--memory", "1", "--top", "3")
    assert code == 0, err
    assert "layouts fit 4 devices of 1.0 GiB" in out and "(--top N shows more)" in out
    rows = [row for row in map(str.split, out.splitlines()) if len(row) == 14 and row[0].isdigit()]
    assert [row[0] for row in rows] == ["1", "2", "3"] and rows[0][1:5] == ["4", "1", "1", "1"]  # dp=4 first
    long = ("--seq-len", "32768", "--micro-batch", "1")
    code, out, err = cli("estimate-memory", model_dir, "--suggest", "--devices", "2", "--memory", "0.15", *long)
    rows = [row for row in map(str.split, out.splitlines()) if len(row) == 14 and row[0].isdigit()]
    assert code == 0 and rows[0][1:5] == ["1", "1", "1", "2"], out  # the whole sequence does not fit: cp=2 first


def test_entry_point_suggests_layouts_for_a_70b_llama_in_seconds(tmp_path):
    LlamaConfig(**LLAMA_70B).save_pretrained(tmp_path)
    start = time.perf_counter()
    args = ("estimate-memory", str(tmp_path), "--suggest", "--devices", "64", "--memory", "80", "--seq-len", "4096")
    result = run(*args)
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    assert "LlamaForCausalLM (llama): 70.55B parameters" in result.stdout and "layouts fit 64 devices" in result.stdout
    assert elapsed < 60, f"{elapsed:.1f} s (process start and imports included)"
    bad = run("estimate-memory", str(tmp_path), "--tp", "3")
    assert bad.returncode == 2 and one_line_error(bad.stderr), bad.stderr
    assert "tensor_parallel_size=3 must divide num_attention_heads=64" in bad.stderr
