"""Start-up cost: `import optimum_parallel`, its public surface and the command line's `--help`, next to importing
torch and transformers, each in a fresh interpreter (page cache warm), as medians.

    python scripts/bench_import.py [--runs 5]

Goals (issue 22): importing the package and its public surface costs at most 0.3 s more than
`import torch, transformers; from transformers import AutoModelForCausalLM`, and its TRL trainers at most 0.3 s more
than importing TRL's own; every `--help` returns in under 1.5 s.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from _common import print_table, timed_rounds

CLI = str(Path(sys.executable).with_name("optimum-parallel"))
# the public surface without the Trainer integrations, whose import is transformers' Trainer's or TRL's own cost
# (timed against those below); the memory planner's names build meta models of the families on first use
WITHOUT = "('.integrations.transformers.trainer', '.integrations.transformers.training_args', '.integrations.trl')"
SURFACE = (
    "import optimum_parallel as op; "
    f"[getattr(op, n) for n, m in op._EXPORTS.items() if not m.startswith({WITHOUT}) "
    "and n not in ('MemoryPlanner', 'estimate_memory', 'suggest_layouts')]"
)
TRL = (
    "import torch, transformers; "
    + "from trl import "
    + ", ".join(
        f"{kind}Trainer, {kind}Config" for kind in ("SFT", "DPO", "GRPO", "KTO", "RLOO", "Reward", "Distillation")
    )
)
TRL_SURFACE = (
    "import optimum_parallel as op; [getattr(op, n) for n, m in op._EXPORTS.items() if m == '.integrations.trl']"
)
CASES = {
    "import torch, transformers (+ AutoModelForCausalLM)": [
        sys.executable, "-c", "import torch, transformers; from transformers import AutoModelForCausalLM"
    ],
    "import optimum_parallel": [sys.executable, "-c", "import optimum_parallel"],
    "import optimum_parallel + its public surface": [sys.executable, "-c", SURFACE],
    "import torch, transformers + the surface": [
        sys.executable, "-c", f"import torch, transformers; from transformers import AutoModelForCausalLM; {SURFACE}"
    ],
    "import TRL's 7 trainers and configs": [sys.executable, "-c", TRL],
    "TRL's 7 + optimum_parallel's TRL trainers": [sys.executable, "-c", f"{TRL}; {TRL_SURFACE}"],
    "optimum-parallel --help": [CLI, "--help"],
    "optimum-parallel plan --help": [CLI, "plan", "--help"],
    "optimum-parallel estimate-memory --help": [CLI, "estimate-memory", "--help"],
    "optimum-parallel consolidate --help": [CLI, "consolidate", "--help"],
    "optimum-parallel reshard --help": [CLI, "reshard", "--help"],
}  # fmt: skip


# as a user's interpreter runs: byte-compiled modules cached (pip compiles a wheel's at install; an editable install's
# are cached on first import). Without this, a PYTHONDONTWRITEBYTECODE=1 environment compiles this package's ~100
# modules from source in every interpreter (~0.15 s), while torch and transformers load the .pyc pip wrote.
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def launcher(command: list[str]):
    """A step that runs `command` in a fresh interpreter (what the harness times)."""
    return lambda: subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    # one warm-up round warms the page cache; then round-robin, so a slow spell of the machine falls on every case alike
    times = timed_rounds([launcher(command) for command in CASES.values()], timed=args.runs, warmup=1)
    medians = {name: seconds.median for name, seconds in zip(CASES, times, strict=True)}
    base = medians["import torch, transformers (+ AutoModelForCausalLM)"]
    print_table(
        (f"what (median of {args.runs} fresh interpreters)", "seconds", "minus torch+transformers (seconds)"),
        [(name, f"{value:.2f}", f"{value - base:+.2f}") for name, value in medians.items()],
        title="import cost",
    )
    extra = medians["import torch, transformers + the surface"] - base
    trl_extra = medians["TRL's 7 + optimum_parallel's TRL trainers"] - medians["import TRL's 7 trainers and configs"]
    worst_help = max(v for n, v in medians.items() if "--help" in n)
    print(f"surface over torch+transformers: {extra:+.2f} s ({'PASS' if extra <= 0.3 else 'FAIL'} <= 0.3)")
    print(f"TRL trainers over TRL's own: {trl_extra:+.2f} s ({'PASS' if trl_extra <= 0.3 else 'FAIL'} <= 0.3)")
    print(f"slowest --help: {worst_help:.2f} s ({'PASS' if worst_help < 1.5 else 'FAIL'} < 1.5)")


if __name__ == "__main__":
    main()
