"""Checks run on every rank: a parallel model against the real single-device transformers model."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from _models import build_model, make_batch, rel_err, tiny_config, whole_logits

from optimum_parallel.comm.shared_memory import SharedMemoryGroup

TOL = 1e-5
STEPS = 3


def train_step(model, optimizer, batch) -> float:
    """Forward, backward and one optimizer step on `batch`; the loss."""
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _reference_and_parallel(model_type: str, tp: int, overrides: dict, sequence_parallel: bool):
    import optimum_parallel as op

    mesh = op.init_mesh(dp=dist.get_world_size() // tp, tp=tp)
    config = tiny_config(model_type, **overrides)
    reference = build_model(config)
    parallel = copy.deepcopy(reference)
    optimizer = torch.optim.AdamW(parallel.parameters(), lr=1e-2, weight_decay=0.1)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(parallel)
    parallel = parallelizer.parallelize(parallel, sequence_parallel_enabled=sequence_parallel)
    optimizer = parallelizer.optimizer_for_mp(optimizer, parallel.orig_param_to_parallel_param)
    return mesh, config, reference, parallel, optimizer


def check_matches_reference(model_type: str, tp: int, overrides: dict, sequence_parallel: bool = False) -> dict:
    """Logits, loss, every gradient, then the loss over STEPS AdamW steps; returns the worst errors."""
    mesh, config, reference, parallel, optimizer = _reference_and_parallel(model_type, tp, overrides, sequence_parallel)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    batch = make_batch(config)

    ref_out = reference(**batch)
    ref_out.loss.backward()
    out = parallel(**batch)
    out.loss.backward()

    errors = {
        "logits": rel_err(whole_logits(parallel, out.logits), ref_out.logits),
        "loss": rel_err(out.loss, ref_out.loss),
    }
    grads = grad_errors(reference, parallel)
    errors["worst_grad"] = max(grads.values())
    errors["worst_grad_name"] = max(grads, key=grads.get)
    errors["n_params"] = len(grads)

    errors["steps"] = worst_loss_over_steps(reference, parallel, ref_optimizer, optimizer, batch)
    return errors


def grad_errors(reference, parallel) -> dict[str, float]:
    ref_params = dict(reference.named_parameters())
    errors = {}
    for name, param in parallel.named_parameters():
        expected = ref_params[name].grad
        layout = getattr(param, "shard_layout", None)
        errors[name] = rel_err(param.grad, layout.slice(expected) if layout is not None else expected)
    return errors


def worst_loss_over_steps(reference, parallel, ref_optimizer, optimizer, batch: dict, steps: int = STEPS) -> float:
    """Step both optimizers on the gradients already computed, then `steps` times: the worst loss error."""
    errors = []
    for _ in range(steps):
        ref_optimizer.step()
        optimizer.step()
        ref_optimizer.zero_grad()
        optimizer.zero_grad()
        ref_loss = reference(**batch).loss
        loss = parallel(**batch).loss
        ref_loss.backward()
        loss.backward()
        errors.append(rel_err(loss, ref_loss))
    return max(errors)


def count_collectives(
    num_layers: int, tp: int, sequence_parallel: bool = False, *, lora_targets: tuple[str, ...] = ()
) -> list[tuple[str, str, int, bool]]:
    """(phase, collective, elements, async) for every torch.distributed call of one forward+backward
    (of a PEFT LoRA model on `lora_targets`, if given)."""
    import optimum_parallel as op

    op.init_mesh(dp=dist.get_world_size() // tp, tp=tp)
    config = tiny_config("llama", num_hidden_layers=num_layers)
    model = build_model(config)
    if lora_targets:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=list(lora_targets), init_lora_weights=False))
    model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(  # the model's own collectives only
        model, sequence_parallel_enabled=sequence_parallel, shared_batch="trust"
    )
    batch = make_batch(config)
    calls, phase = [], ["forward"]
    # torch.distributed's collectives, and the same calls on the shared-memory stand-in of a same-host group
    patched = [(dist, name) for name in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")]
    patched += [(SharedMemoryGroup, name) for name in ("all_reduce", "all_gather", "reduce_scatter")]
    originals = [(owner, name, getattr(owner, name)) for owner, name in patched]

    def recording(name, fn, method):
        def call(*args, **kwargs):
            arguments = args[1:] if method else args
            tensor = arguments[1] if name == "all_gather" else arguments[0]
            calls.append((phase[0], name, tensor.numel(), bool(kwargs.get("async_op"))))
            return fn(*args, **kwargs)

        return call

    for owner, name, fn in originals:
        setattr(owner, name, recording(name, fn, method=owner is SharedMemoryGroup))
    try:
        loss = model(**batch).loss
        phase[0] = "backward"
        loss.backward()
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
    return calls


def error_and_whether_untouched(model, call) -> tuple[str, str, bool]:
    """(error type, message, whether every parameter of `model` is still the same object) of `call()`, which
    should raise ValueError or TypeError before it changes anything; ("", "no error", False) if it does not raise."""
    before = dict(model.named_parameters())
    try:
        call()
    except (ValueError, TypeError) as err:
        return type(err).__name__, str(err), all(p is before[n] for n, p in model.named_parameters())
    return "", "no error", False
