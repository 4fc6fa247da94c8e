"""The XLA lane (`make test-xla`): torch-xla's CPU device (PJRT_DEVICE=CPU) in its own cached environment.

Each scenario runs once per session in a fresh process (`_worker.py`; `_trainer_worker.py` for the Trainer's, whose
CPU reference runs there too, with torch-xla switched off), with a timeout: PJRT fixes the number of devices when it
starts, and a stuck collective must end the run, not hang it. The CPU reference of the tp scenarios is the plain
transformers model in this process, on the whole batch (at dp=2 the global batch of both replicas).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("torch_xla", reason="the XLA lane needs torch-xla: run `make test-xla`")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import EPS, LR, STEPS, load_llama, make_batch, save_tiny_llama  # noqa: E402

WORKER_TIMEOUT_S = 300


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(directory)
    return directory


def train_on_cpu(model_dir: Path, batch: dict[str, torch.Tensor], perturb_seed: int | None = None) -> dict:
    """One CPU process, the whole batch: the first logits, the loss of every step, the first step's gradients, the
    weights after. `perturb_seed`: start from the weights times (1 + 1e-7 x a standard normal draw)."""
    model = load_llama(model_dir)
    if perturb_seed is not None:
        generator = torch.Generator().manual_seed(perturb_seed)
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(1 + 1e-7 * torch.randn(param.shape, generator=generator))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    losses, grads = [], None
    for step in range(STEPS):
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"logits": logits, "losses": losses, "grads": grads, "params": params}


@pytest.fixture(scope="session")
def cpu_reference(model_dir) -> dict:
    """The tp scenarios' reference: their batch (every tp rank holds all of it)."""
    return train_on_cpu(model_dir, make_batch())


@pytest.fixture(scope="session")
def cpu_reference_dp2(model_dir) -> dict:
    """The dp=2 scenario's reference: the global batch of both replicas, in one process."""
    return train_on_cpu(model_dir, make_batch(replicas=2))


@pytest.fixture(scope="session")
def weight_tolerance(model_dir, cpu_reference, cpu_reference_dp2) -> float:
    """The bound on the weights after the AdamW steps, derived from the fp32 noise floor: the same CPU run started
    from weights perturbed by a relative 1e-7 (3 draws, on both batches) ends up to `floor` away from the unperturbed
    one (AdamW divides by sqrt(v), so a float-noise gradient moves its weight by up to lr); a device's run is held to
    2 x floor. (Losses, logits and gradients keep 1e-5: their floor is about 1e-6.)"""
    floor = 0.0
    for replicas, reference in ((1, cpu_reference), (2, cpu_reference_dp2)):
        for seed in (1, 2, 3):
            perturbed = train_on_cpu(model_dir, make_batch(replicas=replicas), perturb_seed=seed)
            for name, expected in reference["params"].items():
                moved = (perturbed["params"][name] - expected).abs().max() / expected.abs().max()
                floor = max(floor, moved.item())
    print(f"\n[xla] fp32 noise floor of the weights after {STEPS} steps: {floor:.2e}; tolerance {2 * floor:.2e}")
    return 2 * floor


class Scenarios:
    """Runs each worker scenario once; what every rank saved, in rank order."""

    def __init__(self, model_dir: Path, root: Path) -> None:
        self.model_dir, self.root, self.done = model_dir, root, {}

    def __call__(self, scenario: str) -> list[dict]:
        if scenario not in self.done:
            out = self.root / scenario
            out.mkdir()
            env = {**os.environ, "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "1"}
            worker = "_trainer_worker.py" if scenario.startswith("trainer") else "_worker.py"
            command = [sys.executable, str(HERE / worker), scenario, str(self.model_dir), str(out)]
            start = time.monotonic()
            run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
            seconds = time.monotonic() - start
            output = run.stdout[-4000:] + run.stderr[-8000:]
            assert run.returncode == 0, f"{scenario} failed ({run.returncode}):\n{output}"
            results = [torch.load(path) for path in sorted(out.glob("rank*.pt"))]
            compiles = results[0]["steps"][-1]["compiles"] if "steps" in results[0] else results[0]["compiles"]
            print(f"\n[xla] {scenario}: {len(results)} rank(s), {seconds:.1f} s, {compiles} compilations")
            self.done[scenario] = (out, results)
        return self.done[scenario][1]

    def directory(self, scenario: str) -> Path:
        self(scenario)
        return self.done[scenario][0]


@pytest.fixture(scope="session")
def scenarios(model_dir, tmp_path_factory) -> Scenarios:
    return Scenarios(model_dir, tmp_path_factory.mktemp("xla-runs"))
