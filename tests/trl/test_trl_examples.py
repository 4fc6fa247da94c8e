"""examples/sft.py and examples/dpo.py under torchrun on 2 CPU processes (tp=2): each trains its tiny model on its toy
task (the loss falls), logs TRL's metrics, and writes a consolidated checkpoint `from_pretrained` loads."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

ROOT = Path(__file__).parent.parent.parent
COMMON = ["--tensor_parallel_size", "2", "--use_cpu", "--bf16", "False", "--report_to", "none", "--max_steps", "40",
          "--logging_steps", "5", "--disable_tqdm", "True", "--save_strategy", "no", "--ddp_timeout", "60"]  # fmt: skip
RUNS = {
    "sft": ["--packing", "--max_length", "64", "--per_device_train_batch_size", "4", "--learning_rate", "5e-3"],
    "dpo": ["--per_device_train_batch_size", "8", "--learning_rate", "1e-2"],
    "distillation": ["--per_device_train_batch_size", "8", "--learning_rate", "1e-2", "--max_completion_length", "8"],
    "reward": ["--per_device_train_batch_size", "8", "--learning_rate", "1e-2", "--sequence_parallel"],
    "kto": ["--per_device_train_batch_size", "8", "--learning_rate", "1e-2"],
}


@pytest.mark.parametrize("example", list(RUNS))
def test_example_trains_under_torchrun(example, tmp_path):
    from transformers import AutoModelForCausalLM

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    script = str(ROOT / "examples" / f"{example}.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", script,
               "--output_dir", str(tmp_path), *COMMON, *RUNS[example]]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = re.search(rf"{example.upper()}: loss ([0-9.]+) -> ([0-9.]+)", done.stdout)
    assert summary is not None, done.stdout[-3000:]
    first, last = map(float, summary.groups())
    assert last < first, summary.group(0)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert model.config.num_hidden_layers == 2
