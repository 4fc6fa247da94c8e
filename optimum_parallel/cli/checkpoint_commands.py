"""`optimum-parallel consolidate | reshard | inspect`: sharded checkpoints on one process, one tensor at a time."""

from __future__ import annotations

import functools
import math

import click


def _checkpoint_errors(fn):
    """Turn the checkpoint code's errors (which name the offending file) into one-line CLI errors."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from ..checkpoint import CheckpointError

        try:
            return fn(*args, **kwargs)
        except (CheckpointError, ValueError, FileExistsError, NotImplementedError) as err:
            raise click.ClickException(str(err)) from None

    return wrapper


_CKPT = click.Path(exists=True, file_okay=False)


@click.command()
@click.argument("checkpoint", type=_CKPT)
@click.argument("output", type=click.Path(file_okay=False))
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest output safetensors file.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a progress bar.")
@_checkpoint_errors
def consolidate(checkpoint: str, output: str, max_shard_size: str, progress: bool) -> None:
    """Turn the sharded CHECKPOINT into a regular Hugging Face checkpoint in OUTPUT.

    Writes model-0000i-of-0000n.safetensors, model.safetensors.index.json and the config, streaming
    one tensor at a time; `from_pretrained(OUTPUT)` loads it.
    """
    from ..checkpoint import consolidate_checkpoint
    from ..checkpoint.consolidate import parse_size

    consolidate_checkpoint(checkpoint, output, max_shard_size=parse_size(max_shard_size), progress=progress)
    click.echo(f"wrote {output}")


@click.command()
@click.argument("checkpoint", type=_CKPT)
@click.argument("output", type=click.Path(file_okay=False))
@click.option("--tp", type=click.IntRange(min=1), required=True, help="Target tensor-parallel size.")
@click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True, help="Target pipeline stages.")
@click.option("--ep", type=click.IntRange(min=1), default=None, help="Target expert-parallel size (default: as saved).")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a progress bar.")
@_checkpoint_errors
def reshard(checkpoint: str, output: str, tp: int, pp: int, ep: int | None, progress: bool) -> None:
    """Convert the sharded CHECKPOINT to another tp / pp / ep layout in OUTPUT, optimizer state included.

    Streams one tensor at a time; never consolidates the whole model. There is no --dp or --cp: data and
    context parallel ranks hold the same shards, so a checkpoint loads at any dp and cp as it is.
    """
    from ..checkpoint import reshard_checkpoint

    reshard_checkpoint(checkpoint, output, tp=tp, pp=pp, progress=progress, ep=ep)
    click.echo(f"wrote {output} (tp={tp}, pp={pp})")


@click.command()
@click.argument("checkpoint", type=_CKPT)
@click.option("--verify", is_flag=True, help="Also re-hash every file (sha256) against the index.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole index as JSON.")
@_checkpoint_errors
def inspect(checkpoint: str, verify: bool, as_json: bool) -> None:
    """Describe the sharded CHECKPOINT: layout, tensors, files; with --verify, check every byte."""
    from ..checkpoint import read_index, verify_checkpoint

    index = verify_checkpoint(checkpoint, full=verify) if verify else read_index(checkpoint)
    if as_json:
        click.echo(index.to_json())
        return
    mesh = ", ".join(f"{k}={v}" for k, v in index.mesh.items())
    params = sum(1 for e in index.tensors.values() if e.kind == "param")
    numel = sum(math.prod(e.global_shape) for e in index.tensors.values())
    split = sum(1 for e in index.tensors.values() if e.dim is not None)
    click.echo(f"{checkpoint}: {index.model_class}, saved at {mesh}")
    click.echo(f"  {len(index.tensors)} tensors ({params} parameters, {split} split), {numel / 1e6:.2f}M values")
    experts = sum(1 for e in index.tensors.values() if e.experts)
    if experts:
        click.echo(f"  {experts} expert tensors, their experts split over ep={index.mesh.get('ep', 1)}")
    if index.tied:
        click.echo(f"  tied: {', '.join(f'{a} -> {c}' for a, c in index.tied.items())}")
    if index.optimizer is not None:
        groups = ", ".join(f"pp rank {r}: {len(g)}" for r, g in sorted(index.optimizer["param_groups"].items()))
        click.echo(f"  optimizer: {index.optimizer['class']} (param groups {groups})")
    for name, info in sorted(index.files.items()):
        click.echo(f"  {name}  {info['size'] / 1e6:10.2f} MB  sha256 {info['sha256'][:16]}")
    click.echo("  verified: every file matches its sha256" if verify else "  (use --verify to re-hash every file)")
