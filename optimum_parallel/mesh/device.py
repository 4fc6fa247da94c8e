"""Everything device-specific, in one module: which accelerator, which process-group backend, and the few device
calls the package makes (set the device, synchronize, memory, random state, autocast, pinned memory).

The accelerator is torch's (`torch.accelerator.current_accelerator()`: CUDA, Trainium's native backend `neuron`
(TorchNeuron, a PrivateUse1 device), Ascend `npu`, Intel `xpu`, ...) or one named by the caller; the backend is what
the device's package registered (`torch.distributed.get_default_backend_for_device`: nccl, neuron, hccl, xccl, gloo
on the CPU). XLA devices (torch-neuronx <= 2.9, torch-xla) are the one exception torch's registry does not cover:
their tensors compile into a graph per program, so ranks must never appear in them as constants
(`is_graph_device`), and the "xla" backend starts from torch-xla's runtime. Nothing outside this module names a
device type or calls `torch.cuda`; `tests/test_architecture.py` greps for it.
"""

from __future__ import annotations

import os
import socket
import types
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

XLA = "xla"  # torch-xla's device type and backend name
HOST = "cpu"
NEURON_COMPILER = "neuron"  # TorchNeuron's torch.compile backend: static shapes, registered by its package


def compile_dynamic(backend: str) -> bool | None:
    """torch.compile's `dynamic` for the compiler `backend`: False for TorchNeuron's (static shapes, as transformers
    asks of it), None (torch decides on the second shape seen) for the others."""
    return False if backend == NEURON_COMPILER else None


def missing_compiler_hint(backend: str) -> str:
    """What to install when torch does not know the compiler `backend` ("" where there is nothing to say)."""
    return " (TorchNeuron, installed with its device, provides it)" if backend == NEURON_COMPILER else ""


def is_graph_device(device: torch.device | str | torch.Tensor | None) -> bool:
    """Whether tensors on `device` are traced into compiled graphs (XLA): what differs by rank must be data."""
    return _type(device) == XLA


def is_host(device: torch.device | str | torch.Tensor | None) -> bool:
    """Whether `device` is the host CPU (host memory, host kernels)."""
    return _type(device) == HOST


def _type(device: torch.device | str | torch.Tensor | None) -> str | None:
    if device is None:
        return None
    if isinstance(device, torch.Tensor):
        return device.device.type
    return torch.device(device).type if not isinstance(device, torch.device) else device.type


def xla_requested() -> bool:
    """torch-xla's runtime is configured (`PJRT_DEVICE`) or the process group already runs on the "xla" backend."""
    return bool(os.environ.get("PJRT_DEVICE")) or (dist.is_initialized() and dist.get_backend() == XLA)


def current_accelerator() -> torch.device | None:
    """torch's accelerator where this process can use it: None on a machine without one, even under a torch built
    for one (a CUDA build reports "cuda" on a host without a GPU unless asked to check). A build for an accelerator
    that cannot use it warns once, naming the reason (the job then runs on the CPU)."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is None:
        _warn_unusable_accelerator()
    return accelerator


_WARNED: list[str] = []


def _warn_unusable_accelerator() -> None:
    built_for = torch.accelerator.current_accelerator(check_available=False)
    if built_for is None or built_for.type in _WARNED:
        return
    _WARNED.append(built_for.type)
    warnings.warn(
        f"torch is built for {built_for.type} but this process cannot use it ({unusable_reason(built_for.type)}): "
        f"the job runs on the CPU with gloo. Pass device={built_for.type!r} to init_mesh to make this an error",
        stacklevel=3,
    )


def unusable_reason(device_type: str) -> str:
    """Why torch's accelerator `device_type` is not available here: the visible-devices variable, the device count,
    or the error its initialisation raises (a driver too old for the wheel, ...)."""
    module = torch.get_device_module(device_type)
    visible = {k: v for k, v in os.environ.items() if k.endswith("_VISIBLE_DEVICES") and k.split("_")[0] in
               (device_type.upper(), "HIP", "ROCR", "ZE", "ASCEND", "NEURON")}  # fmt: skip
    if any(value.strip() in ("", "-1", "none", "NoDevFiles") for value in visible.values()):
        return ", ".join(f"{k}={v!r}" for k, v in visible.items()) + " hides every device"
    init = getattr(module, "init", None)
    if callable(init):
        try:
            init()
        except Exception as err:  # the driver's own words
            return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else err!r}"
    try:
        count = module.device_count()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return f"{count} devices visible" if count == 0 else f"{device_type} reports itself unavailable"


def available_device_types() -> list[str]:
    """The device types this process can run on: the CPU, and the accelerator torch reports (if any)."""
    accelerator = current_accelerator()
    return [HOST] + ([accelerator.type] if accelerator is not None else [])


def resolve_device_type(device: torch.device | str | None = None) -> str:
    """The device the mesh runs on: `device` (any device type torch knows, available here), else XLA where
    torch-xla is configured, else torch's current accelerator, else the CPU."""
    if device is None:
        if xla_requested():
            return XLA
        accelerator = current_accelerator()
        return accelerator.type if accelerator is not None else HOST
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as err:
        raise ValueError(
            f"device={device!r} is not a device torch knows ({err}); available here: "
            f"{', '.join(available_device_types() + [XLA])}"
        ) from None
    if kind in (HOST, XLA):
        return kind
    available = available_device_types()
    if kind not in available:
        raise ValueError(
            f"device={device!r} is not available in this process; available here: {', '.join(available)} "
            "(an accelerator is available once its torch package is installed and imported, e.g. torch_neuronx, "
            "torch_npu)"
        )
    return kind


def backend_for(device_type: str) -> str:
    """The process-group backend of `device_type`: the one its package registered with torch.distributed."""
    if device_type == XLA:
        return XLA
    try:
        return dist.get_default_backend_for_device(device_type)
    except ValueError:
        known = ", ".join(f"{d}: {b}" for d, b in sorted(dist.Backend.default_device_backend_map.items()))
        raise ValueError(
            f"no torch.distributed backend is registered for device {device_type!r}; registered: {known}"
        ) from None


def backend_options(backend: str, timeout: timedelta):
    """Options carrying `timeout` for process groups of `backend` (DeviceMesh's sub-groups otherwise get torch's
    30-minute default): gloo's and NCCL's own option types; for another registered backend an object carrying the
    timeout, which is what DeviceMesh reads from it."""
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
    elif backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
    else:
        return types.SimpleNamespace(_timeout=timeout)
    options._timeout = timeout
    return options


def local_device_index(local_rank: int | None = None) -> int:
    """This process's device: its place on its host (`local_rank`, the launcher's; by default `LOCAL_RANK`) when it
    sees several devices, else 0 (one visible device per process)."""
    count = torch.accelerator.device_count()
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return local_rank % count if count > 1 else 0


def set_process_device(
    device_type: str, bound: torch.device | None = None, local_rank: int | None = None
) -> torch.device | None:
    """Make this process's device current, before any group exists (NCCL-like backends bind to it, and torch's
    DeviceMesh would otherwise pick `LOCAL_RANK` itself, an index a one-device process does not have); returns it,
    the `device_id` for `init_process_group` (None on the CPU and XLA). `bound`: the device a caller's own default
    group is bound to; a caller that made the group and chose a device already keeps it. `local_rank`: this
    process's place on its host, as its launcher says (mesh/launchers.py; by default `LOCAL_RANK`)."""
    if device_type in (HOST, XLA):
        return None
    if bound is not None:
        index = bound.index
    elif _device_chosen(device_type):
        index = torch.accelerator.current_device_index()
    else:
        index = local_device_index(local_rank)
    torch.accelerator.set_device_index(index)
    return torch.device(device_type, index)


def _device_chosen(device_type: str) -> bool:
    """Whether a caller that made the default group itself already set a device (torch's DeviceMesh's own test)."""
    if not dist.is_initialized():
        return False
    is_initialized = getattr(torch.get_device_module(device_type), "is_initialized", None)
    return bool(is_initialized()) if callable(is_initialized) else False


def device_identity(device: torch.device) -> str:
    """The physical device behind `device` on this host: its UUID where the device module reports one (CUDA: the
    same GPU under any CUDA_VISIBLE_DEVICES numbering), else its index."""
    try:
        uuid = getattr(torch.get_device_module(device.type).get_device_properties(device), "uuid", None)
    except Exception:  # a module without device properties
        uuid = None
    return f"{device.type} {uuid}" if uuid else f"{device.type}:{device.index}"


def host_identity(node: str | None = None) -> str:
    """This process's host among the job's: the launcher's node number (`node`: SLURM_NODEID, torchrun's GROUP_RANK,
    read by default) where it gives one, else the host name."""
    if node is None:
        node = os.environ.get("GROUP_RANK")
    return f"node {node} ({socket.gethostname()})" if node is not None else socket.gethostname()


EXCLUSIVE_BACKENDS = frozenset({"nccl"})  # one process per device: NCCL stops at "Duplicate GPU detected"


def shares_devices(backend: str) -> bool:
    """Whether several ranks of one host may drive one device under `backend` (not NCCL)."""
    return backend not in EXCLUSIVE_BACKENDS


def duplicate_devices(claims: dict[int, tuple[str, str]]) -> str | None:
    """From each rank's (host, device identity): an error message naming the ranks that share a device, or None."""
    by_device: dict[tuple[str, str], list[int]] = {}
    for rank, claim in sorted(claims.items()):
        by_device.setdefault(claim, []).append(rank)
    shared = {claim: ranks for claim, ranks in by_device.items() if len(ranks) > 1}
    if not shared:
        return None
    listed = "; ".join(f"ranks {', '.join(map(str, r))} on {host}: {dev}" for (host, dev), r in shared.items())
    return (
        f"two or more local ranks map to one device, which their backend cannot share ({listed}). Give each rank of "
        "a host its own device: under torchrun, one process per device (--nproc-per-node <= devices per host) with "
        "every device visible to each (CUDA_VISIBLE_DEVICES the same for all ranks of a host, or unset); each rank "
        "then uses device LOCAL_RANK"
    )


def current_device(device_type: str | None = None) -> torch.device:
    """The device this process computes on: its current accelerator device, or the CPU."""
    if device_type is None:
        accelerator = current_accelerator()
        device_type = accelerator.type if accelerator is not None else HOST
    if device_type in (HOST, XLA):
        return torch.device(HOST) if device_type == HOST else _xla_device()
    return torch.device(device_type, torch.accelerator.current_device_index())


def _xla_device() -> torch.device:
    import torch_xla  # loaded already wherever an XLA mesh exists

    return torch_xla.device()


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where small tensors for a collective on `group` must live: the device its backend serves, from the group's
    actual backends (`dist.get_backend(group)`, "gloo", "nccl" or a mixed "cpu:gloo,cuda:nccl"): this process's
    accelerator device where a backend of the group serves it, else the CPU where gloo (or another CPU backend)
    does. Raises for a backend string it cannot place."""
    return device_for_backend(str(dist.get_backend(group)))


def device_for_backend(backend: str) -> torch.device:
    """`collective_device` for a backend string: "gloo", "nccl", "cpu:gloo,cuda:nccl", ..."""
    served: dict[str, str] = {}  # device type -> backend
    for part in (p.strip() for p in backend.split(",") if p.strip()):
        kind, _, name = part.rpartition(":")
        if kind:
            served[kind] = name
        else:
            served.update(_devices_of(name, backend))
    accelerator = current_accelerator()
    if accelerator is not None and accelerator.type in served:
        return current_device(accelerator.type)
    if HOST in served:
        return torch.device(HOST)
    if XLA in served:
        return _xla_device()
    raise ValueError(
        f"process group backend {backend!r} runs on {', '.join(sorted(served)) or 'no device torch knows'}, and "
        f"this process's devices are {', '.join(available_device_types())}; known backends: {_known_backends()}"
    )


def _devices_of(name: str, whole: str) -> dict[str, str]:
    """The device types a plain backend name serves: those torch registered it for (gloo: the CPU)."""
    if name == XLA:
        return {XLA: XLA}
    registered = dist.Backend.backend_capability.get(name.lower())
    if registered is None:
        raise ValueError(f"process group backend {whole!r}: {name!r} is not a backend torch knows; known: "
                         f"{_known_backends()}")  # fmt: skip
    devices = [d for d in registered if d != "cuda" or name.lower() != "gloo"]  # gloo: CPU tensors (device_check)
    return dict.fromkeys(devices, name)


def _known_backends() -> str:
    return ", ".join(sorted(dist.Backend.backend_capability))


def synchronize(device: torch.device | str | None) -> None:
    """Wait for the work queued on `device` (nothing on the CPU; XLA cuts and runs its graph, see `sync_graph`)."""
    if device is None or is_host(device):
        return
    if is_graph_device(device):
        sync_graph(device)
        return
    torch.accelerator.synchronize(torch.device(device))


def sync_graph(device: torch.device | str | None) -> None:
    """On an XLA device, cut the pending graph here and run it (`torch_xla.sync()`): one per optimizer step, after
    the step, so the step is one compiled program; elsewhere nothing (eager devices run as they go)."""
    if device is not None and is_graph_device(device):
        import torch_xla  # loaded already: the tensors are on an XLA device

        torch_xla.sync()


def memory_allocated(device: torch.device | str) -> int:
    """Bytes of device memory tensors hold now (0 on the CPU and XLA: not tracked there)."""
    if is_host(device) or is_graph_device(device):
        return 0
    return torch.accelerator.memory_allocated(torch.device(device))


def max_memory_allocated(device: torch.device | str) -> int:
    if is_host(device) or is_graph_device(device):
        return 0
    return torch.accelerator.max_memory_allocated(torch.device(device))


def empty_cache(device: torch.device | str) -> None:
    if not (is_host(device) or is_graph_device(device)):
        torch.accelerator.empty_cache()


def rng_states() -> dict[str, torch.Tensor]:
    """The random states a checkpoint keeps: the CPU's, and the current accelerator's (every device of its type)."""
    states = {HOST: torch.get_rng_state()}
    accelerator = current_accelerator()
    if accelerator is not None:
        module = torch.get_device_module(accelerator.type)
        if hasattr(module, "get_rng_state"):
            states[accelerator.type] = module.get_rng_state()
    return states


def set_rng_states(states: dict[str, torch.Tensor]) -> None:
    """Restore what `rng_states` returned (an accelerator this process does not have is skipped)."""
    for kind, state in states.items():
        if kind == HOST:
            torch.set_rng_state(state.cpu())
            continue
        accelerator = current_accelerator()
        if accelerator is not None and accelerator.type == kind:
            module = torch.get_device_module(kind)
            if hasattr(module, "set_rng_state"):
                module.set_rng_state(state.cpu())


def seeded_rng_states(seed: int) -> dict[str, torch.Tensor]:
    """Random states as `rng_states` gives them, of generators seeded with `seed` (the current ones untouched)."""
    states = {HOST: torch.Generator().manual_seed(seed).get_state()}
    accelerator = current_accelerator()
    if accelerator is not None:
        module = torch.get_device_module(accelerator.type)
        if hasattr(module, "get_rng_state") and hasattr(module, "manual_seed"):
            current = module.get_rng_state()
            module.manual_seed(seed)
            states[accelerator.type] = module.get_rng_state()
            module.set_rng_state(current)
    return states


_KEEPS_PARAMETERS: dict[str, bool] = {}


def module_to_keeps_parameters(device: torch.device | str) -> bool:
    """Whether `Module.to(device)` moves host parameters in place (`param.data = ...`), keeping the Parameter
    objects and everything that refers to them (tied weights, parameter maps, attributes). torch does so only between
    its own dense backends (CPU, CUDA, XPU, HPU, MPS, ...); tensors of a PrivateUse1 device (TorchNeuron, Ascend's
    torch_npu) or of XLA are of another kind, and `Module.to` gives every module a new Parameter instead: one per
    module, so even tied weights come apart."""
    kind = _type(device) or HOST
    if kind not in _KEEPS_PARAMETERS:
        if kind in (HOST, XLA):
            _KEEPS_PARAMETERS[kind] = kind == HOST
        else:  # asked of torch itself: an empty tensor of each kind, no data moved
            probe = torch.empty(0, device=kind)
            _KEEPS_PARAMETERS[kind] = torch._has_compatible_shallow_copy_type(torch.empty(0), probe)
    return _KEEPS_PARAMETERS[kind]


def pin(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in pinned host memory when the accelerator has pinned memory (faster, asynchronous copies), else
    the tensor itself."""
    if current_accelerator() is None or not is_host(tensor) or lacks_pinned_memory():
        return tensor
    return tensor.pin_memory()


_PINS: list[bool] = []  # whether the accelerator pins host memory, once asked


def lacks_pinned_memory() -> bool:
    """Whether this process has an accelerator that cannot pin host memory (a PrivateUse1 backend without torch's
    pinned-memory hook): `tensor.pin_memory()`, and a DataLoader with `pin_memory=True`, would raise there. False
    without an accelerator (nothing is pinned then: DataLoader pins only for an accelerator)."""
    if current_accelerator() is None:
        return False
    if not _PINS:
        try:
            _PINS.append(torch.empty(1).pin_memory().is_pinned())
        except (RuntimeError, NotImplementedError):
            _PINS.append(False)
    return not _PINS[0]
