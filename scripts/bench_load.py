"""Loading a ~0.5B Llama at tp=2: optimum-parallel (lazy slice reads) next to transformers' own tensor parallelism.

Builds and saves two random-init Llama-style checkpoints under --workdir (bf16 in several safetensors files, and
fp32 in one file), then, in fresh torchrun process groups, loads each at tp=2 with

  optimum-parallel:  with lazy_load_for_parallelism(2): from_pretrained(...); Parallelizer.parallelize(model)
  transformers:      from_pretrained(..., distributed_config=DistributedConfig(tp_size=2))

and prints per-rank peak RSS (VmHWM), the process's RSS after imports, the rank's shard bytes and the load
time (fastest run and medians), and the floor (faulting in fresh memory for the rank's bytes, then reading them from
the page cache into it). Goals: load time <= 0.6x transformers', peak
<= 0.7x transformers' and <= after-imports + 1.15 x shard bytes. It then times
`consolidate` of a tp=2 sharded checkpoint against a plain copy of the same bytes, with consolidate's peak RSS.

    python scripts/bench_load.py [--workdir /tmp/op-bench-load] [--tp 2] [--repeats 2] [--checkpoints fp32-one-file]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from _common import LLAMA_0_5B, Stopwatch, local_tensor, now, proc_status_bytes, record

CONFIG = LLAMA_0_5B
IMPLS = ("optimum-parallel", "transformers")


CHECKPOINTS = {  # name: (dtype, max_shard_size): the two cases
    "bf16-files": ("bfloat16", "300MB"),  # several files
    "fp32-one-file": ("float32", "10GB"),  # one model.safetensors
}


def build_checkpoint(path: Path, kind: str, layers: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if any(path.glob("model*.safetensors")):
        return
    dtype, shard_size = CHECKPOINTS[kind]
    print(f"building the checkpoint in {path} ...", flush=True)
    torch.manual_seed(0)
    config = LlamaConfig(**{**CONFIG, "num_hidden_layers": layers})
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    print(f"  {sum(p.numel() for p in model.parameters()) / 1e9:.3f}B parameters", flush=True)
    model.save_pretrained(path, max_shard_size=shard_size)


def worker(impl: str, checkpoint: str, result_dir: str, sharded_out: str | None) -> None:
    """One rank under torchrun: load `checkpoint` at tp=WORLD_SIZE with `impl`, write this rank's numbers.
    Each path's entry points are imported before the timer (transformers' DistributedConfig, our
    lazy_load_for_parallelism and ParallelizersManager): start-up cost is scripts/bench_import.py's."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import optimum_parallel as op
    from optimum_parallel import ParallelizersManager, lazy_load_for_parallelism

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    import transformers.modeling_utils  # noqa: F401  both paths import it on first from_pretrained (~0.9 s, torch._dynamo)

    dtype = json.loads(Path(checkpoint, "config.json").read_text()).get("dtype") or "bfloat16"
    dtype = getattr(torch, dtype)

    if impl == "optimum-parallel":
        op.init_mesh(tp=world)
    else:
        dist.init_process_group("gloo")
    dist.barrier()
    after_imports = proc_status_bytes("VmRSS")
    start = now()
    if impl == "optimum-parallel":
        with lazy_load_for_parallelism(tensor_parallel_size=world):
            model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
        parallelizer = ParallelizersManager.parallelizer_for_model(model)
        model = parallelizer.parallelize(model)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=dtype, distributed_config=DistributedConfig(tp_size=world)
        )
    dist.barrier()
    seconds = now() - start
    peak = proc_status_bytes("VmHWM")

    tensors = [local_tensor(t.detach()) for t in [*model.parameters(), *model.buffers()]]
    # a weight that is still a view of the file mapping is only read when first used: touch every page
    with Stopwatch() as touch:
        for t in tensors:
            t.reshape(-1)[:: max(1, 4096 // t.element_size())].float().sum()
        dist.barrier()
    touched = touch.seconds
    shard = sum(t.numel() * t.element_size() for t in tensors)
    rank = dist.get_rank()
    result = {"impl": impl, "rank": rank, "after_imports": after_imports, "peak": peak, "shard": shard, "s": seconds}
    result.update(touch_s=touched, peak_touched=proc_status_bytes("VmHWM"))
    result.update(_read_floor(Path(checkpoint), shard, rank))
    Path(result_dir, f"{impl}-{rank}.json").write_text(json.dumps(result))
    if sharded_out:
        parallelizer.save_model_checkpoint(model, sharded_out)
        dist.barrier()
        timed = _time_sharded_load(parallelizer, model, Path(sharded_out), Path(result_dir))
        Path(result_dir, f"ckpt-{rank}.json").write_text(json.dumps(timed))
    dist.destroy_process_group()


def _read_floor(checkpoint: Path, size: int, rank: int) -> dict[str, float]:
    """The floor of a load, in two parts: faulting in `size` bytes of fresh memory (one madvise, as our reads do),
    then reading this rank's share of the checkpoint (from byte rank x size on, across its files) from the page
    cache into it, one pread per file."""
    import torch

    from optimum_parallel.io.fresh_memory import populated_empty

    files = sorted(checkpoint.glob("*.safetensors"))
    with Stopwatch() as fault:
        memory = populated_empty((size,), torch.uint8)
    start = now()
    buffer, done, skip = memoryview(memory.numpy()), 0, rank * size
    for f in files:
        length = f.stat().st_size
        if skip >= length:
            skip -= length
            continue
        with open(f, "rb", buffering=0) as stream:
            stream.seek(skip)
            while done < size and (n := stream.readinto(buffer[done : done + (1 << 30)])):
                done += n
        skip = 0
        if done >= size:
            break
    return {"floor_fault_s": fault.seconds, "floor_read_s": now() - start}


def _time_sharded_load(parallelizer, model, sharded: Path, result_dir: Path) -> dict:
    """load_model_checkpoint of our own sharded checkpoint into the live model, against a plain copy of this
    rank's files (page cache to page cache, as the load reads from it), both timed on this rank."""
    import torch.distributed as dist

    rank = dist.get_rank()
    files = sorted(sharded.glob(f"model-pp*-tp{rank:02d}*.safetensors")) or sorted(sharded.glob("model-*.safetensors"))
    target = result_dir / f"copy-rank{rank}"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    dist.barrier()
    with Stopwatch() as copy:
        for f in files:
            shutil.copyfile(f, target / f.name)
    shutil.rmtree(target)
    dist.barrier()
    with Stopwatch() as load:
        parallelizer.load_model_checkpoint(model, sharded)  # into lazily loaded weights: file mappings, copied on write
    dist.barrier()
    with Stopwatch() as resident:
        parallelizer.load_model_checkpoint(model, sharded)  # again, into weights now resident (as after training steps)
    size = sum(f.stat().st_size for f in files)
    return {"ckpt_load_s": load.seconds, "ckpt_resident_s": resident.seconds, "ckpt_copy_s": copy.seconds,
            "ckpt_bytes": size}  # fmt: skip


def timed_child(kind: str, source: str, output: str, result: str) -> None:
    """A fresh process that consolidates `source` (or copies its model files) into `output`."""
    after_imports = 0
    if kind == "consolidate":
        import optimum_parallel as op

        after_imports = proc_status_bytes("VmRSS")
        start = now()
        op.consolidate_checkpoint(source, output, progress=False)
    else:
        after_imports = proc_status_bytes("VmRSS")
        start = now()
        Path(output).mkdir(parents=True)
        for f in sorted(Path(source).glob("model-pp*.safetensors")):
            shutil.copyfile(f, Path(output) / f.name)
            with open(Path(output) / f.name, "rb+") as copy:  # durable, as consolidate's files are
                os.fsync(copy.fileno())
    seconds = now() - start
    data = {"s": seconds, "peak": proc_status_bytes("VmHWM"), "after_imports": after_imports}
    Path(result).write_text(json.dumps(data))


def _warm_page_cache(directory: Path) -> None:
    """Read the checkpoint once so every run starts from the same (warm) page cache."""
    for f in sorted(directory.glob("*.safetensors")):
        with open(f, "rb") as stream:
            while stream.read(64 << 20):
                pass


def _same_page_cache(directory: Path) -> None:
    """Start each timed run from the same state: no dirty pages, and (as root) an emptied page cache with only
    `directory` read back in (as a warm cache). On a VM, page-cache pages the guest never touched cost far more to
    fill than recycled ones (a 0.9 GB write took 0.2 s or 2.3 s by that alone), which otherwise decides which run
    looks faster."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass  # not root: dirty pages flushed is all we can do
    _warm_page_cache(directory)


def _env() -> dict[str, str]:
    """The children's environment: one thread per rank, and byte-compiled modules cached as in a user's interpreter
    (a PYTHONDONTWRITEBYTECODE=1 environment would compile the modules a first load imports inside the timer)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}


def _torchrun(tp: int, *args: str) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}", __file__]
    subprocess.run([*command, *args], check=True, env=_env())


def _child(*args: str) -> None:
    subprocess.run([sys.executable, __file__, *args], check=True, env=_env())


GB = 1 << 30


def _bench_loads(args, hf_dir: Path, kind: str, results: Path, sharded: Path | None) -> None:
    """Both loads of `hf_dir`, `args.repeats` times each in alternating order, then their table; with `sharded`,
    our first run also saves a sharded checkpoint there and times load_model_checkpoint from it."""
    history: dict[str, list[tuple[float, float]]] = {impl: [] for impl in IMPLS}  # (load, load + first use)
    for repeat in range(args.repeats):
        for impl in IMPLS if repeat % 2 == 0 else IMPLS[::-1]:  # alternate who goes first
            extra = ["--sharded-out", str(sharded)] if sharded and impl == "optimum-parallel" and repeat == 0 else []
            _same_page_cache(hf_dir)
            _torchrun(args.tp, "--worker", impl, "--checkpoint", str(hf_dir), "--results", str(results), *extra)
            runs = [json.loads(f.read_text()) for f in results.glob(f"{impl}-*.json")]
            history[impl].append((max(r["s"] for r in runs), max(r["s"] + r["touch_s"] for r in runs)))

    on_disk = sum(f.stat().st_size for f in hf_dir.glob("*.safetensors"))
    files = len(list(hf_dir.glob("*.safetensors")))
    print(f"\nload at tp={args.tp} of {hf_dir} ({kind}: {files} file(s), {on_disk / GB:.2f} GiB)")
    header = (
        f"{'':17} {'rank':>4} {'after imports':>13} {'shard':>9} {'goal':>9} {'peak at load':>19} {'load s':>6}"
        f" | {'peak once used':>21} {'load+use s':>10}"
    )
    print(header)
    print("-" * len(header))
    for impl in IMPLS:
        for rank in range(args.tp):
            r = json.loads((results / f"{impl}-{rank}.json").read_text())
            goal = r["after_imports"] + 1.15 * r["shard"]
            ratio = (r["peak"] - r["after_imports"]) / r["shard"]
            used_ratio = (r["peak_touched"] - r["after_imports"]) / r["shard"]
            print(
                f"{impl:17} {rank:>4} {r['after_imports'] / GB:>9.2f} GiB {r['shard'] / GB:>5.2f} GiB "
                f"{goal / GB:>5.2f} GiB {r['peak'] / GB:>5.2f} GiB ({ratio:.2f}x) {_verdict(r['peak'], goal)}"
                f" {r['s']:>6.2f} | {r['peak_touched'] / GB:>5.2f} GiB ({used_ratio:.2f}x) "
                f"{_verdict(r['peak_touched'], goal)} {r['s'] + r['touch_s']:>10.2f}"
            )
    for impl, seconds in history.items():
        print(f"  {impl} load time over {args.repeats} runs: {', '.join(f'{t[0]:.2f}' for t in seconds)} s")
    ours = [json.loads((results / f"optimum-parallel-{r}.json").read_text()) for r in range(args.tp)]
    fault, read = max(r["floor_fault_s"] for r in ours), max(r["floor_read_s"] for r in ours)
    print(
        f"  floor for a rank's shard bytes (the last run): reading them from the page cache {read:.2f} s, "
        f"faulting in fresh memory for them {fault:.2f} s ({fault / (ours[0]['shard'] / 4096) * 1e6:.1f} us a page)"
    )
    print("  (goal = after imports + 1.15 x shard; NNx = (peak - after imports) / shard; a weight left as a view")
    print("   of the file mapping is read when first used, so 'once used' touches every page of every weight)")
    print("  (table: the last run; times below: the fastest run of each, then the medians)")
    peaks = {
        impl: max(json.loads((results / f"{impl}-{r}.json").read_text())["peak_touched"] for r in range(args.tp))
        for impl in IMPLS
    }
    for column, what in ((0, "load"), (1, "load + first use")):
        best = {impl: min(t[column] for t in history[impl]) for impl in IMPLS}
        middle = {impl: statistics.median(t[column] for t in history[impl]) for impl in IMPLS}
        op_s, hf_s = best["optimum-parallel"], best["transformers"]
        for impl in IMPLS:
            table = f"{kind} at tp={args.tp}"
            record(
                impl,
                f"{what} fastest s",
                best[impl],
                "s",
                ratio_to=best[impl] / hf_s,
                table=table,
                text=f"{best[impl]:.2f}",
            )
            record(impl, f"{what} median s", middle[impl], "s", ratio_to=middle[impl] / middle["transformers"],
                   table=table, text=f"{middle[impl]:.2f}")  # fmt: skip
        print(
            f"{kind} {what} time: optimum-parallel {op_s:.2f} s, transformers {hf_s:.2f} s "
            f"(ours / transformers {op_s / hf_s:.2f}x, goal <= 0.6x; medians {middle['optimum-parallel']:.2f} s, "
            f"{middle['transformers']:.2f} s, {middle['optimum-parallel'] / middle['transformers']:.2f}x)"
        )
    for impl in IMPLS:
        ratio = peaks[impl] / peaks["transformers"]
        record(impl, "peak once used GiB", peaks[impl] / GB, "GiB", ratio_to=ratio, table=f"{kind} at tp={args.tp}",
               text=f"{peaks[impl] / GB:.2f} ({ratio:.2f}x)")  # fmt: skip
    print(
        f"{kind} peak once used: optimum-parallel / transformers "
        f"{peaks['optimum-parallel'] / peaks['transformers']:.2f}x (goal <= 0.7x)"
    )
    if not sharded:
        return
    print(f"\nload_model_checkpoint of our tp={args.tp} sharded checkpoint into the parallelized model, per rank")
    for rank in range(args.tp):
        r = json.loads((results / f"ckpt-{rank}.json").read_text())
        print(
            f"  rank {rank}: {r['ckpt_bytes'] / GB:.2f} GiB, plain copy of its files {r['ckpt_copy_s']:.2f} s, "
            f"load_model_checkpoint {r['ckpt_load_s']:.2f} s ({r['ckpt_load_s'] / r['ckpt_copy_s']:.2f}x the copy)"
            f" into mapped weights, {r['ckpt_resident_s']:.2f} s ({r['ckpt_resident_s'] / r['ckpt_copy_s']:.2f}x)"
            " into resident ones"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/tmp/op-bench-load")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument(
        "--layers", type=int, default=CONFIG["num_hidden_layers"], help="fewer: a smaller model (a quick look)"
    )
    parser.add_argument("--repeats", type=int, default=2, help="loads per implementation (alternating order)")
    parser.add_argument(
        "--part", choices=("all", "consolidate"), default="all", help="consolidate: reuse the last sharded checkpoint"
    )
    parser.add_argument(
        "--checkpoints", nargs="+", choices=tuple(CHECKPOINTS), default=tuple(CHECKPOINTS), help="which loads to time"
    )
    parser.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--timed", choices=("consolidate", "copy"), help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)
    parser.add_argument("--sharded-out", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.checkpoint, args.results, args.sharded_out)
    if args.timed:
        return timed_child(args.timed, args.checkpoint, args.output, args.results)

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    results = work / "results"
    shutil.rmtree(results, ignore_errors=True)
    results.mkdir()
    sharded = work / "sharded"
    if args.part == "all":
        shutil.rmtree(sharded, ignore_errors=True)
        for kind in args.checkpoints:
            hf_dir = work / (("hf" if kind == "bf16-files" else kind) + _layers_suffix(args.layers))
            build_checkpoint(hf_dir, kind, args.layers)
            _bench_loads(args, hf_dir, kind, results, sharded if kind == "bf16-files" else None)
    if not (sharded / "parallel_checkpoint.json").exists():
        return  # the sharded checkpoint comes from the bf16 load
    timings: dict[str, list[dict]] = {"copy": [], "consolidate": []}
    for repeat in range(args.repeats):  # alternate who goes first: fresh page-cache pages cost more on a VM
        for kind in ("copy", "consolidate") if repeat % 2 == 0 else ("consolidate", "copy"):
            output = work / f"{kind}-out"
            shutil.rmtree(output, ignore_errors=True)
            result = results / f"{kind}.json"
            _same_page_cache(sharded)
            _child("--timed", kind, "--checkpoint", str(sharded), "--output", str(output), "--results", str(result))
            timings[kind].append(json.loads(result.read_text()))
    runs_text = {kind: ", ".join(f"{r['s']:.2f}" for r in runs) for kind, runs in timings.items()}
    timings = {kind: min(runs, key=lambda r: r["s"]) for kind, runs in timings.items()}
    size = sum(f.stat().st_size for f in sharded.glob("model-pp*.safetensors"))
    largest = max(f.stat().st_size for f in (work / "consolidate-out").glob("*.safetensors"))
    c, p = timings["consolidate"], timings["copy"]
    for kind, r in (("plain copy + fsync", p), ("consolidate", c)):
        record(kind, "fastest s", r["s"], "s", ratio_to=r["s"] / p["s"], table=f"consolidate at tp={args.tp}",
               text=f"{r['s']:.2f} ({r['s'] / p['s']:.2f}x)")  # fmt: skip
        record(
            kind,
            "peak RSS GiB",
            r["peak"] / GB,
            "GiB",
            table=f"consolidate at tp={args.tp}",
            text=f"{r['peak'] / GB:.2f}",
        )
    print(f"\nconsolidate of the tp={args.tp} sharded checkpoint ({size / GB:.2f} GiB of model shards; fastest runs)")
    print(f"  runs: copy {runs_text['copy']} s; consolidate {runs_text['consolidate']} s")
    print(f"  plain copy of the same bytes (shutil.copyfile + fsync): {p['s']:.2f} s")
    print(f"  consolidate (incl. crc32 checks, fsync):            {c['s']:.2f} s ({c['s'] / p['s']:.2f}x the copy)")
    print(
        f"  consolidate peak RSS {c['peak'] / GB:.2f} GiB = after imports {c['after_imports'] / GB:.2f} GiB "
        f"+ {(c['peak'] - c['after_imports']) / GB:.2f} GiB (largest tensor {_largest_tensor(sharded) / GB:.3f} GiB, "
        f"largest output file {largest / GB:.2f} GiB)"
    )


def _layers_suffix(layers: int) -> str:
    """The checkpoint directories of a smaller model get names of their own (a built checkpoint is reused)."""
    return "" if layers == CONFIG["num_hidden_layers"] else f"-{layers}-layers"


def _verdict(peak: int, goal: float) -> str:
    return f"{'ok' if peak <= goal else 'OVER':>4}"


def _largest_tensor(sharded: Path) -> int:
    index = json.loads((sharded / "parallel_checkpoint.json").read_text())
    sizes = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
    best = 0
    for entry in index["tensors"].values():
        n = sizes.get(entry["dtype"], 4)
        for s in entry["global_shape"]:
            n *= s
        best = max(best, n)
    return best


if __name__ == "__main__":
    main()
