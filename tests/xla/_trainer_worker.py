"""Trains the tiny Llama for 3 steps with a Trainer and writes what each rank saw to OUT/rank<N>.pt.

    python _trainer_worker.py trainer-cpu MODEL_DIR OUT       # transformers' Trainer on the CPU (USE_TORCH_XLA=0)
    python _trainer_worker.py trainer-cpu-dp2 MODEL_DIR OUT   # the same on dp=2's global batches (4 rows a step)
    python _trainer_worker.py trainer-tp1 MODEL_DIR OUT       # ParallelTrainer, one XLA device
    python _trainer_worker.py trainer-tp2 MODEL_DIR OUT       # ParallelTrainer, tp=2 on two XLA devices, a thread each
    python _trainer_worker.py trainer-dp2 MODEL_DIR OUT       # ParallelTrainer, dp=2 over two XLA devices

Each rank records per step, without reading a device value until training is over: the loss and the grad norm
(device tensors), and at each step's end how many syncs its thread made and how many device-to-host transfers and
compilations the process made. Syncs (the package's, transformers' `xm.mark_step`) are serialized and counted.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from pathlib import Path

# (XLA devices, tp, dp): no devices is transformers' Trainer on the CPU, on dp batches of 2 rows at once
SCENARIOS = {
    "trainer-cpu": (0, 1, 1),
    "trainer-cpu-dp2": (0, 1, 2),
    "trainer-tp1": (1, 1, 1),
    "trainer-tp2": (2, 2, 1),
    "trainer-dp2": (2, 1, 2),
}
LOCK = threading.Lock()
SYNCS: dict[int, int] = {}
STEP_ENDS: list[threading.Barrier] = []  # several devices: no thread leaves a step's end before all recorded it


def counted_sync(original):
    """torch_xla.sync (xm.mark_step calls it too) one thread at a time, counted per device."""
    import torch_xla.runtime as xr

    def sync(*args, **kwargs):
        with LOCK:
            me = xr.global_ordinal()
            SYNCS[me] = SYNCS.get(me, 0) + 1
            return original(*args, **kwargs)

    sync.counts = SYNCS
    return sync


def dataset(steps: int) -> list[dict]:
    """`steps` batches of `make_batch` (2 sequences each: padding, -100 labels), as one sample per row. The Trainer
    shuffles the rows: at dp=2 a replica's two rows may hold fewer labelled tokens than the other's, which the
    token count over the global batch (`average_tokens_across_devices`) must make up for."""
    from _common import make_batch

    return [{k: v[i] for k, v in make_batch(seed=s).items()} for s in range(steps) for i in range(2)]


def run(index: int, scenario: str, model_dir: str, out: str) -> None:
    try:
        _run(scenario, model_dir, out)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _run(scenario: str, model_dir: str, out: str) -> None:
    devices, tp, dp = SCENARIOS[scenario]
    with LOCK:  # first imports one thread at a time: transformers' lazy module is not thread-safe
        import torch
        from _common import EPS, LR, STEPS, load_llama, shard_pieces
        from transformers import Trainer, TrainerCallback, TrainingArguments

        import optimum_parallel as op
        from optimum_parallel.mesh import ranks

        if devices:
            import torch_xla
            import torch_xla.debug.metrics as met

            if not hasattr(torch_xla.sync, "counts"):  # once per process (torch_xla.launch runs in a new one)
                torch_xla.sync = counted_sync(torch_xla.sync)
                if devices > 1:
                    STEP_ENDS.append(threading.Barrier(devices, timeout=120))
            mesh = op.init_mesh(dp=dp, tp=tp, device="xla", timeout=120)
    me = ranks.global_rank() if devices else 0
    if devices:
        assert ranks.world_size() == devices and mesh.device_type == "xla", (ranks.world_size(), devices)
        assert (mesh.size("dp"), mesh.size("tp")) == (dp, tp)

    def counters() -> dict:
        if not devices:
            return {"syncs": 0, "transfers": 0, "compiles": 0}
        transfers, compiles = met.metric_data("TransferFromDeviceTime"), met.metric_data("CompileTime")
        return {
            "syncs": SYNCS.get(me, 0),
            "transfers": transfers[0] if transfers else 0,
            "compiles": compiles[0] if compiles else 0,
        }

    record: dict = {"losses": [], "grad_norms": [], "steps": []}

    class Counters(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            record["begin"] = counters()

        def on_step_end(self, args, state, control, **kwargs):
            record["steps"].append(counters())
            for barrier in STEP_ENDS:  # the counters are the process's: the first thread done with training reads
                barrier.wait()  # values (transformers' train_loss) that the other's last step must not see

    def recording(base):
        class Recording(base):
            def training_step(self, *args, **kwargs):
                loss = super().training_step(*args, **kwargs)
                record["losses"].append(loss)
                return loss

            def _get_grad_norm(self, model, grad_norm=None):
                norm = super()._get_grad_norm(model, grad_norm=grad_norm)
                record["grad_norms"].append(norm)
                return norm

        return Recording

    settings = dict(
        output_dir=str(Path(out) / f"run{me}"),
        per_device_train_batch_size=2 if devices else 2 * dp,  # the CPU takes the dp replicas' rows at once
        max_steps=STEPS,
        learning_rate=LR,
        adam_epsilon=EPS,
        optim="adamw_torch",
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        # the sampler's own seed: two devices' Trainers are two threads of one process, and without it each
        # sampler seeds from the process's global generator, which the other thread may reseed in between
        data_seed=0,
    )
    model, rows = load_llama(model_dir), dataset(STEPS * dp)
    refusal = None
    if devices and dp > 1:  # ZeRO-1 is refused at dp > 1 on XLA, before the model changes
        args = op.ParallelTrainingArguments(tensor_parallel_size=tp, sharding_level=1, **settings)
        try:
            op.ParallelTrainer(model, args, train_dataset=rows)
        except ValueError as refused:
            refusal = str(refused)
        assert refusal is not None and type(model).__name__ == "LlamaForCausalLM", refusal
    if devices:
        args = op.ParallelTrainingArguments(tensor_parallel_size=tp, **settings)
        trainer = recording(op.ParallelTrainer)(model, args, train_dataset=rows, callbacks=[Counters()])
    else:
        args = TrainingArguments(use_cpu=True, **settings)
        trainer = recording(Trainer)(model, args, train_dataset=rows, callbacks=[Counters()])
    trainer.train()
    params = dict(trainer.model.named_parameters())
    result = {
        "ordinal": me,
        "world": ranks.world_size() if devices else 1,
        "device": str(next(iter(params.values())).device),
        "losses": [loss.detach().cpu().item() for loss in record["losses"]],
        "grad_norms": [float(norm) for norm in record["grad_norms"]],
        "begin": record["begin"],
        "steps": record["steps"],
        "params": shard_pieces(params, params),
        "refusal": refusal,
    }
    torch.save(result, Path(out) / f"rank{me}.pt")


def main() -> None:
    scenario, model_dir, out = sys.argv[1:4]
    devices, _, _ = SCENARIOS[scenario]
    if not devices:
        os.environ["USE_TORCH_XLA"] = "0"  # transformers and accelerate leave torch-xla alone: a CPU run
        run(0, scenario, model_dir, out)
        return
    os.environ["PJRT_DEVICE"] = "CPU"
    os.environ["CPU_NUM_DEVICES"] = str(devices)
    if devices > 1:
        # One process, a thread per device, syncs serialized: a graph that both updates parameters in place (their
        # buffers donated to it) and holds collectives runs to its end inside torch_xla.sync on PJRT's CPU client,
        # so the first thread would wait in a collective for the second, which waits for the lock. Without
        # donation the run returns at once, as on a device per process (Neuron), where no lock is needed.
        os.environ["XLA_ENABLE_PARAM_ALIASING"] = "0"
    import torch_xla

    if devices == 1:
        run(0, scenario, model_dir, out)
    else:
        torch_xla.launch(run, args=(scenario, model_dir, out))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
