"""`optimum-parallel plan | estimate-memory`: what goes where, and how much memory each rank needs (config only,
no weights, no processes)."""

from __future__ import annotations

import functools

import click

_MODEL = click.Path(exists=True)
_DTYPE = click.Choice(["fp32", "bf16", "fp16"])


def _context() -> click.Context | None:
    return click.get_current_context(silent=True)


def _config(model: str):
    """The transformers config of a model directory or a config.json path; a bad one is a bad MODEL argument."""
    from pathlib import Path

    import transformers
    from transformers import AutoConfig

    transformers.logging.set_verbosity_error()  # deprecation chatter would bury the table
    path = Path(model)
    if path.is_dir() and not (path / "config.json").is_file():
        raise click.BadParameter(f"no config.json in directory {model!r}", ctx=_context(), param_hint="MODEL")
    try:
        return AutoConfig.from_pretrained(str(path))  # a directory or a config.json path
    except (OSError, ValueError, KeyError, TypeError) as err:
        message = " ".join(str(err).split())
        raise click.BadParameter(
            f"cannot read a transformers config from {model!r}: {message}", ctx=_context(), param_hint="MODEL"
        ) from None


def _planning_errors(fn):
    """Arguments that do not fit the model (tp vs heads, pp vs layers) are usage errors (exit 2); an unsupported
    model type or feature is a plain error (exit 1); both on one line."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from ..frontends.manager import UnsupportedModelError

        try:
            return fn(*args, **kwargs)
        except (UnsupportedModelError, NotImplementedError, OSError) as err:
            raise click.ClickException(" ".join(str(err).split())) from None
        except ValueError as err:
            raise click.UsageError(" ".join(str(err).split()), ctx=_context()) from None

    return wrapper


@click.command()
@click.argument("model", type=_MODEL)
@click.option("--tp", type=click.IntRange(min=1), required=True, help="Tensor-parallel size to plan for.")
@click.option("--dtype", type=_DTYPE, default=None, help="Parameter dtype for the bytes (default: the config's).")
@click.option(
    "--embeddings/--no-embeddings", default=True, show_default=True, help="Split the embedding and the LM head too."
)
@click.option(
    "--sequence-parallel", is_flag=True, help="Record the sequence-parallel plan in --save's file (layouts are equal)."
)
@click.option("--save", "save_path", type=click.Path(dir_okay=False), default=None, help="Also write the plan as JSON.")
@_planning_errors
def plan(model: str, tp: int, dtype: str | None, embeddings: bool, sequence_parallel: bool, save_path: str | None):
    """Show which parameters the model family's plan splits how at tensor-parallel size --tp, and the
    parameter bytes per rank.

    MODEL is a model directory or a config.json; only the config is read (the model is built on the meta
    device), so it works for any size on one process. With --save, the resolved plan (every module's style,
    every parameter's layout on every rank) is written as a plan file for `optimum_parallel.load_plan`.
    """
    from ..memory_planner.report import plan_report
    from ..memory_planner.workload import DTYPES

    config = _config(model)
    click.echo(plan_report(config, tp, parallelize_embeddings=embeddings, dtype=DTYPES[dtype] if dtype else None))
    if save_path:
        from ..memory_planner.plan_files import save_plan

        save_plan(
            config,
            save_path,
            tp=tp,
            parallelize_embeddings=embeddings,
            sequence_parallel_enabled=sequence_parallel,
        )
        click.echo(f"wrote plan file {save_path}")


def _explicit(ctx: click.Context, name: str) -> bool:
    return ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT)


@click.command("estimate-memory")
@click.argument("model", type=_MODEL)
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True, help="Tensor-parallel size.")
@click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True, help="Pipeline stages.")
@click.option("--dp", type=click.IntRange(min=1), default=1, show_default=True, help="Data-parallel size.")
@click.option(
    "--cp",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Context-parallel size: ranks each sequence is split over (ring attention); they hold the same weights.",
)
@click.option(
    "--ep",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Expert-parallel size (mixture-of-experts models): the experts split over ep of the dp x cp ranks.",
)
@click.option(
    "--sharding-level",
    type=click.IntRange(0, 3),
    default=0,
    show_default=True,
    help="0 DDP, 1 + optimizer state sharded (ZeRO-1), 2 + gradients (FSDP2), 3 + parameters (FSDP2 reshard).",
)
@click.option(
    "--shard-size",
    type=int,
    default=-1,
    show_default=True,
    help="Ranks per sharding group (hybrid sharding: shard inside a group, replicate across); -1: all dp x cp.",
)
@click.option("--seq-len", type=click.IntRange(min=1), default=2048, show_default=True, help="Tokens per sequence.")
@click.option(
    "--micro-batch", type=click.IntRange(min=1), default=1, show_default=True, help="Sequences per micro-batch."
)
@click.option(
    "--num-microbatches",
    type=click.IntRange(min=1),
    default=None,
    help="Pipeline micro-batches per step [default: pp].",
)
@click.option(
    "--schedule", type=click.Choice(["1f1b", "gpipe"]), default="1f1b", show_default=True, help="Pipeline schedule."
)
@click.option("--dtype", type=_DTYPE, default="bf16", show_default=True, help="Parameter and activation dtype.")
@click.option(
    "--master-weights/--no-master-weights",
    default=None,
    help="16-bit: fp32 master copy + fp32 AdamW m, v (12 B/param) [default], or m, v in the dtype (2 x 2 B/param).",
)
@click.option("--attention", type=click.Choice(["sdpa", "eager"]), default="sdpa", show_default=True)
@click.option(
    "--activations",
    "activation_method",
    type=click.Choice(["auto", "llama", "paper"]),
    default="auto",
    show_default=True,
    help="Activation count in the total: Korthikanti et al. 2022 ('paper'), this engine's Llama count ('llama'), "
    "or 'llama' for Llama-style decoders and 'paper' otherwise.",
)
@click.option(
    "--async-save", is_flag=True, help="Count the host memory of async checkpoint saves (a snapshot of the shards)."
)
@click.option("--suggest", is_flag=True, help="List the layouts that fit --devices of --memory GiB, best first.")
@click.option("--devices", type=click.IntRange(min=1), default=None, help="Devices for --suggest.")
@click.option(
    "--memory", type=click.FloatRange(min=0, min_open=True), default=None, help="GiB per device for --suggest."
)
@click.option(
    "--reserve",
    type=click.FloatRange(0, 1, max_open=True),
    default=0.1,
    show_default=True,
    help="Fraction of --memory kept free for the runtime, fragmentation and temporary buffers (--suggest).",
)
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True, help="Suggestions to show.")
@click.pass_context
@_planning_errors
def estimate_memory(
    ctx: click.Context,
    model: str,
    tp: int,
    pp: int,
    dp: int,
    cp: int,
    ep: int,
    sharding_level: int,
    shard_size: int,
    seq_len: int,
    micro_batch: int,
    num_microbatches: int | None,
    schedule: str,
    dtype: str,
    master_weights: bool | None,
    attention: str,
    activation_method: str,
    async_save: bool,
    suggest: bool,
    devices: int | None,
    memory: float | None,
    reserve: float,
    top: int,
) -> None:
    """Per-rank bytes of parameters, gradients, AdamW state and activations for a dp x tp x pp x cp layout, with
    and without sequence parallelism; with --suggest --devices N --memory GiB, the layouts that fit, best first.

    MODEL is a model directory or a config.json; only the config is read (a meta model gives the exact
    per-rank parameter counts of the family's plan), so a 70B model takes seconds on a laptop. Activations:
    Korthikanti et al. 2022 per layer, sbh(34 + 5as/h) at tp=1, sbh(10 + 24/t + 5as/(ht)) at tp=t, sbh(34/t +
    5as/(ht)) with SP (16-bit, scaled to --dtype), and for Llama-style decoders the count of this engine's
    Llama (checked against measurement). Under pp, 1F1B keeps pp micro-batches in flight on the first stage
    (GPipe: all of them on every stage). Under cp, activations are those of seq/cp tokens plus ring attention's
    K/V blocks in flight; sharding levels split the states over dp x cp, or over groups of --shard-size of them.
    Under --ep (mixture-of-experts models) each rank keeps num_experts / ep of every block's experts (the sharding
    levels split their states over the dp x cp / ep ranks holding the same experts), and activations add the
    dispatched rows; --suggest proposes ep for such models, with pp and at every level.
    """
    from ..memory_planner.estimate import MemoryPlanner
    from ..memory_planner.memory_text import format_estimate, format_suggestions
    from ..memory_planner.workload import GIB, Layout, Workload

    if suggest:
        missing = [f"--{name}" for name, value in (("devices", devices), ("memory", memory)) if value is None]
        if missing:
            raise click.UsageError(f"--suggest needs {' and '.join(missing)}")
        fixed = [
            f"--{n.replace('_', '-')}"
            for n in ("tp", "pp", "dp", "cp", "ep", "sharding_level", "shard_size")
            if _explicit(ctx, n)
        ]
        if fixed:
            raise click.UsageError(f"--suggest chooses {', '.join(fixed)} itself; leave {'/'.join(fixed)} out")
    else:
        stray = [f"--{n}" for n in ("devices", "memory") if _explicit(ctx, n)]
        if stray:
            raise click.UsageError(f"{' and '.join(stray)} only apply with --suggest")
    workload = Workload(
        seq_len=seq_len,
        micro_batch=micro_batch,
        num_microbatches=num_microbatches,
        schedule=schedule,
        dtype=dtype,
        master_weights=master_weights,
        attention=attention,
        activations=activation_method,
        async_save=async_save,
    )
    planner = MemoryPlanner(_config(model))
    if suggest:
        estimates = planner.suggest(devices, memory * GIB, workload, reserve=reserve)
        click.echo(format_suggestions(planner, estimates, devices, memory * GIB, reserve, top), nl=False)
        if not estimates:
            raise click.ClickException(
                f"no layout of {devices} devices fits {memory} GiB per device; add devices or memory, or shorten "
                "--seq-len / --micro-batch"
            )
        return
    off = planner.estimate(Layout(dp, tp, pp, sharding_level, False, cp, shard_size, ep), workload)
    with_sp = Layout(dp, tp, pp, sharding_level, True, cp, shard_size, ep)
    on = planner.estimate(with_sp, workload) if tp > 1 and planner.refusal(with_sp, workload) is None else None
    click.echo(format_estimate(planner, off, on), nl=False)
