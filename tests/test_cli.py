"""The `optimum-parallel` command line, run as a user would (subprocesses, torchrun for the demo)."""

from __future__ import annotations

import os
import subprocess
import sys

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
