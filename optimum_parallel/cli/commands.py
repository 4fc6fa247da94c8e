"""`optimum-parallel` command line: the group, its one-line errors and the demo; the checkpoint commands
(checkpoint_commands.py) and the planning commands (planning_commands.py) are added to it here."""

from __future__ import annotations

import os
import subprocess
import sys

import click

from .checkpoint_commands import consolidate, inspect, reshard
from .planning_commands import estimate_memory, plan


class _Group(click.Group):
    """Click's group, with every error on one line (the message and where to find help) instead of a usage block."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as err:
            err.show()
            sys.exit(err.exit_code)
        except click.ClickException as err:
            hint = ""
            if isinstance(err, click.UsageError) and err.ctx is not None:
                hint = f" (see '{err.ctx.command_path} --help')"
            message = " ".join(err.format_message().split())  # one line, whatever the message holds
            click.echo(f"Error: {message}{hint}", err=True)
            sys.exit(err.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
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


for _command in (consolidate, reshard, inspect, plan, estimate_memory):  # checkpoint and planning commands
    main.add_command(_command)

if __name__ == "__main__":
    main(prog_name="optimum-parallel")
