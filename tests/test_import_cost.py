"""What `import optimum_parallel` and the command line load: heavy modules only when first used (issue: start at the
speed of the disk). Each check runs in a fresh interpreter, so nothing a test imported before can hide a load."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = (
    "torch._dynamo",  # through torch.distributed.pipelining
    "torch.distributed.pipelining",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.optim",
    "peft",
    "accelerate",  # ~0.1 s: lazy loading imports it when a model is first built under it
    "torch_xla",  # only where the mesh runs on XLA devices
)
SURFACE = "[getattr(op, name) for name in op.__all__ if name not in LATER]"
LATER = (
    "ParallelTrainer",
    "ParallelTrainerMixin",
    "ParallelTrainingArguments",
    "ParallelSFTTrainer",  # and TRL (an optional dependency)
    "ParallelSFTConfig",
    "ParallelDPOTrainer",
    "ParallelDPOConfig",
    "ParallelGRPOTrainer",
    "ParallelGRPOConfig",
    "ParallelKTOTrainer",
    "ParallelKTOConfig",
    "ParallelRLOOTrainer",
    "ParallelRLOOConfig",
    "ParallelRewardTrainer",
    "ParallelRewardConfig",
    "ParallelDistillationTrainer",
    "ParallelDistillationConfig",
    "MemoryPlanner",
    "estimate_memory",
    "suggest_layouts",
)


def _loaded_after(code: str, modules: tuple[str, ...]) -> list[str]:
    probe = f"import sys\n{code}\nprint('LOADED:' + ','.join(m for m in {modules!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("LOADED:"))
    return [m for m in line.removeprefix("LOADED:").split(",") if m]


def test_import_loads_nothing_heavy():
    assert _loaded_after("import optimum_parallel", ("torch", "transformers", *HEAVY)) == []


def test_the_public_surface_loads_no_pipeline_dtensor_fsdp_or_peft():
    code = f"import optimum_parallel as op\nLATER = {LATER!r}\n{SURFACE}"
    assert _loaded_after(code, HEAVY) == []


@pytest.mark.parametrize("args", [["--help"], ["plan", "--help"], ["estimate-memory", "--help"], ["reshard", "--help"]])
def test_cli_help_imports_no_torch(args):
    run = "try:\n    main()\nexcept SystemExit:\n    pass"
    code = f"from optimum_parallel.cli import main\nsys.argv = ['optimum-parallel', *{args!r}]\n{run}"
    assert _loaded_after(code, ("torch", "transformers")) == []


def test_a_parallelized_model_without_adapters_never_imports_peft(tmp_path):
    code = (
        "import torch.distributed as dist, optimum_parallel as op\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/rdzv', rank=0, world_size=1)\n"
        "from transformers import LlamaConfig, AutoModelForCausalLM\n"
        "config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,"
        " num_attention_heads=2, num_key_value_heads=2)\n"
        "op.init_mesh(tp=1)\n"
        "model = op.ParallelizersManager.parallelizer_for_model(AutoModelForCausalLM.from_config(config))"
        ".parallelize(AutoModelForCausalLM.from_config(config))\n"
    )
    assert _loaded_after(code, ("peft",)) == []
