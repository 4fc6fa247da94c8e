"""`optimum-parallel` command line."""

from __future__ import annotations

import os
import subprocess
import sys

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="optimum-parallel")
def main() -> None:
    """Tensor, sequence, pipeline and data parallelism for Hugging Face Transformers models."""


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


@main.command()
@click.option("--tp", default=2, show_default=True, help="Tensor-parallel size (processes to launch).")
@click.option("--steps", default=20, show_default=True, help="Training steps.")
@click.option("--batch", default=8, show_default=True, help="Sequences per batch.")
@click.option("--seq", default=64, show_default=True, help="Tokens per sequence.")
@click.option("--output-dir", default=None, help="Where to write the demo checkpoint (default: a temp dir).")
def demo(tp: int, steps: int, batch: int, seq: int, output_dir: str | None) -> None:
    """Train a small Llama with tensor parallelism and compare its loss with one process.

    Runs under `torchrun --nproc-per-node N optimum-parallel demo`, or launches torchrun itself.
    """
    if not _under_torchrun():
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={tp}",
            "-m",
            "optimum_parallel.cli",
            "demo",
            f"--steps={steps}",
            f"--batch={batch}",
            f"--seq={seq}",
        ]
        if output_dir:
            command.append(f"--output-dir={output_dir}")
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        sys.exit(subprocess.call(command, env=env))
    from .demo import run_demo

    if run_demo(steps=steps, batch=batch, seq=seq, output_dir=output_dir) > 0:
        raise click.ClickException("parallel and single-process losses differ by more than fp32 noise explains")


if __name__ == "__main__":
    main()
