"""The mean reward per step of GRPO on the toy sum task (`examples/grpo.py`): TRL's GRPOTrainer on one process and
ParallelGRPOTrainer at tp=2 under torchrun, from the same random-init tiny Llama, side by side.

    python scripts/grpo_reward_curve.py [--steps 30] [--tp 2]

The sampled tokens differ between the two runs from the first step on (the parallel model's forwards in training
mode, generate's included, draw their split regions' seeds from the default random stream, which one device does
not), so the curves are two samples of the same learning, not the same numbers.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "grpo.py"
STEP = re.compile(r"^step (\d+): mean reward ([0-9.]+)$", re.MULTILINE)


def rewards(command: list[str]) -> dict[int, float]:
    """Run `command` (the example) and read its `step N: mean reward R` lines."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return {int(step): float(value) for step, value in STEP.findall(done.stdout)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tp", type=int, default=2)
    cli = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="grpo-curve-") as scratch:
        common = ["--steps", str(cli.steps)]
        one = rewards([sys.executable, str(EXAMPLE), "--output-dir", f"{scratch}/one", "--one-process", *common])
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cli.tp)]
        parallel = rewards([*torchrun, str(EXAMPLE), "--output-dir", f"{scratch}/tp", "--tp", str(cli.tp), *common])
    print(f"| step | one process (TRL GRPOTrainer) | tp={cli.tp} (ParallelGRPOTrainer) |")
    print("|---:|---:|---:|")
    for step in sorted(set(one) | set(parallel)):
        print(f"| {step} | {one.get(step, float('nan')):.4f} | {parallel.get(step, float('nan')):.4f} |")
    for name, curve in (("one process", one), (f"tp={cli.tp}", parallel)):
        steps = sorted(curve)
        first, last = steps[:5], steps[-5:]
        early, late = sum(curve[s] for s in first) / len(first), sum(curve[s] for s in last) / len(last)
        print(
            f"{name}: mean reward of steps {first[0]}-{first[-1]} {early:.4f}, of steps {last[0]}-{last[-1]} {late:.4f}"
        )


if __name__ == "__main__":
    main()
