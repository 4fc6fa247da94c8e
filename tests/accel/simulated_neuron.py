"""A simulated `neuron` accelerator: a PrivateUse1 device named like AWS Trainium's native backend (TorchNeuron),
whose memory is host memory, so that the engine can run on a device that is neither CPU nor CUDA on a CPU-only
machine.

- Memory: a neuron storage aliases a host buffer that it keeps alive (`_HostBuffer`, counted by the memory stats).
- Compute: one boxed fallback runs every aten op on zero-copy CPU views of its neuron arguments and hands the
  results back as neuron tensors (fresh results adopt the CPU result's memory, views alias their input's storage);
  copies, resize_, set_ and histc (which counts integers, as accelerators do) have their own kernels. Results equal
  the CPU's bit for bit.
- Communication: the process-group backend "neuron_gloo" (`get_default_backend_for_device("neuron")`) is gloo; the
  c10d collectives' PrivateUse1 kernels run it on host views.
- C++ (`neuron_hooks.cpp`, built once per machine into ~/.cache/optimum-parallel/neuron-ext, ~10 s): what Python
  cannot register -- a Philox-shaped generator (`torch.Generator("neuron")`, DTensor random ops), pinned memory,
  the storage resize hook (FSDP2), a device guard that rejects `neuron:1`, torch.accelerator's synchronize and
  memory stats. Without a compiler (or with NEURON_SIM_PURE_PYTHON=1) the pure-Python device still trains, runs
  collectives, DTensor and FSDP2; those hooks then raise as torch does for an unhooked PrivateUse1 backend.
- The ecosystem: accelerate and transformers find TorchNeuron by its package, `torch_neuronx`; an empty module of
  that name stands for it (accelerate then sets the Trainer up as MULTI_NEURON on `neuron:0`).
- Not simulated: inductor (torch.compile cannot generate code for it), more than one device per process, CPU
  collectives on a group made by `init_process_group()` without a backend (as with NCCL: no CPU backend in it).

`install()` once per process, before any neuron tensor; `counters()` / `reset_counters()` tell a test how many ops
and collectives really ran on the device.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
import types
import warnings

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map

NAME = "neuron"
BACKEND = "neuron_gloo"
_DEVICE: torch.device  # neuron:0, once `install` named the device
_CPU = torch.device("cpu")
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_SET = torch.ops.aten.set_.source_Storage_storage_offset
_EXT_DIR = os.path.expanduser(os.environ.get("NEURON_SIM_EXT_DIR", "~/.cache/optimum-parallel/neuron-ext"))
# CPU tensors that may meet neuron tensors in one op (as on CUDA: copies across devices, CPU index tensors)
_MIXED_OK = {"copy_", "_copy_from", "_copy_from_and_resize", "index", "index_put_", "_index_put_impl_", "index_put"}

_counts: collections.Counter = collections.Counter()
_state = types.SimpleNamespace(installed=False, cpp=None, generator=None, libs=[], shadows={}, in_flight=[])


def counters() -> dict:
    """{'ops': aten ops the device ran, 'collectives': collectives its backend ran, 'storage_resizes': ..., and per
    name 'op:<aten overload>' / 'collective:<c10d overload>'}."""
    return dict(_counts)


def reset_counters() -> None:
    _counts.clear()


def hooks_built() -> bool:
    """Whether the C++ hooks are in (generators, pinned memory, torch.accelerator memory stats, neuron:1 checks)."""
    return _state.cpp is not None


# ---- memory: neuron storages over host buffers ----------------------------------------------------------------
class _Memory:
    current = peak = allocated = freed = 0


class _HostBuffer:
    """Host memory that a neuron storage lives on; counted while alive (memory_allocated and friends)."""

    __slots__ = ("storage", "nbytes")

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.storage, self.nbytes = storage, storage.nbytes()
        _Memory.current += self.nbytes
        _Memory.allocated += self.nbytes
        _Memory.peak = max(_Memory.peak, _Memory.current)

    def data_ptr(self) -> int:
        return self.storage.data_ptr()

    def __del__(self) -> None:
        _Memory.current -= self.nbytes
        _Memory.freed += self.nbytes


def _storage_over(host: torch.UntypedStorage | None) -> torch.UntypedStorage:
    """A neuron storage over `host` (a CPU storage it keeps alive), or an empty one."""
    ptr = host.data_ptr() if host is not None else 0
    storage = torch._C._construct_storage_from_data_pointer(ptr, _DEVICE, host.nbytes() if host is not None else 0)
    storage._host = _HostBuffer(host) if host is not None else None  # kept with the storage (PyObject preservation)
    if _state.cpp is not None:
        _state.cpp.make_resizable(storage)
    return storage


def _on(storage: torch.UntypedStorage, like: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """A neuron tensor (`into`, or a new one) on `storage` with `like`'s dtype, offset, sizes and strides."""
    if into is not None:
        t = into
    elif _state.cpp is not None:
        t = _state.cpp.empty_tensor(like)
    else:
        t = torch._C._acc.create_empty_tensor([0], like.dtype)
    return _SET.redispatch(_CPU_KEYS, t, storage, like.storage_offset(), like.size(), like.stride())


def _host(t: torch.Tensor) -> torch.Tensor:
    """The CPU view of a neuron tensor: same memory, same offset, sizes and strides (a CPU tensor is itself)."""
    if t.device.type != NAME:
        return t
    s = t.untyped_storage()
    hs = torch._C._construct_storage_from_data_pointer(s.data_ptr(), _CPU, s.nbytes())
    return torch.empty(0, dtype=t.dtype).set_(hs, t.storage_offset(), t.size(), t.stride())


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    hs = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), _CPU, storage.nbytes())
    return torch.empty(0, dtype=torch.uint8).set_(hs)


def _swap(storage: torch.UntypedStorage, other: torch.UntypedStorage) -> None:
    if hasattr(storage, "_swap_data_ptr_"):
        storage._swap_data_ptr_(other)
    else:  # torch 2.9
        _state.cpp.swap_storage(storage, other)


def _resize_storage(storage: torch.UntypedStorage, nbytes: int) -> None:
    """Storage resize_ (FSDP2 frees and re-allocates unsharded parameters this way): new host memory, old bytes kept."""
    old = storage.nbytes()
    if nbytes == old:
        return
    _counts["storage_resizes"] += 1
    fresh = _storage_over(torch.empty(nbytes, dtype=torch.uint8).untyped_storage() if nbytes else None)
    if min(old, nbytes):
        _bytes(fresh)[: min(old, nbytes)].copy_(_bytes(storage)[: min(old, nbytes)])
    if old and nbytes:  # _swap_data_ptr_ swaps only when one side is empty: park the old memory first
        _swap(storage, _storage_over(None))
    _swap(storage, fresh)  # `fresh` now holds the old memory and frees it when it goes
    storage._host, fresh._host = fresh._host, getattr(storage, "_host", None)


def _patch_untyped_storage() -> None:
    """Pure-Python device: storage resize_ (no resize hook) and UntypedStorage(n, device="neuron") (no allocator:
    torch would dereference a null one) in Python."""
    resize, new = torch.UntypedStorage.resize_, torch.UntypedStorage.__new__

    def resize_(self, nbytes):
        return _resize_storage(self, nbytes) or self if self.device.type == NAME else resize(self, nbytes)

    def __new__(cls, *args, device=None, **kwargs):
        if device is not None and torch.device(device).type == NAME and len(args) == 1 and isinstance(args[0], int):
            _check_device(torch.device(device))
            return _storage_over(torch.empty(args[0], dtype=torch.uint8).untyped_storage())
        return new(cls, *args, **kwargs) if device is None else new(cls, *args, device=device, **kwargs)

    torch.UntypedStorage.resize_, torch.UntypedStorage.__new__ = resize_, __new__


def _cpp_alloc(nbytes: int) -> _HostBuffer:  # the C++ allocator's memory (UntypedStorage(n, device="neuron"))
    return _HostBuffer(torch.empty(nbytes, dtype=torch.uint8).untyped_storage())


def _cpp_stats() -> tuple[int, int, int, int]:
    return _Memory.current, _Memory.peak, _Memory.allocated, _Memory.freed


_cpp_resize = _resize_storage


# ---- compute: one fallback on host views ----------------------------------------------------------------------
def _check_device(device: torch.device) -> None:
    if device.index not in (None, 0):
        raise RuntimeError(f"{device} does not exist: this process sees 1 {NAME} device ({NAME}:0)")


def _fallback(op, *args, **kwargs):
    """Runs `op` on CPU views of its neuron tensors and returns neuron tensors: an in-place or out= result is the
    neuron argument itself, a view is a view of its input's neuron storage, a fresh result adopts the CPU memory."""
    _counts["ops"] += 1
    _counts[f"op:{op.__name__}"] += 1
    if op in _KERNELS:
        return _KERNELS[op](*args, **kwargs)
    return _on_host(op, *args, **kwargs)


def _on_host(op, *args, **kwargs):
    """`op`'s CPU kernel on host views of its neuron arguments (see `_fallback`)."""
    views, storages, gens, target, adopt = {}, {}, [], [_DEVICE], set()

    def down(x):
        if isinstance(x, torch.Tensor) and x.device.type == NAME:
            _check_device(x.device)
            h = _host(x)
            views[id(h)] = (h, x)
            if x.untyped_storage().data_ptr():
                storages[x.untyped_storage().data_ptr()] = x.untyped_storage()
            return h
        if isinstance(x, torch.Tensor) and x.dim() and op.__name__.split(".")[0] not in _MIXED_OK:
            raise RuntimeError(f"{op.__name__}: expected all tensors on {NAME}:0, found a cpu tensor {tuple(x.shape)}")
        if isinstance(x, torch.device):
            target[0] = x
            if x.type == NAME:
                _check_device(x)
                return _CPU
        if isinstance(x, torch.Generator) and x.device.type == NAME:  # a CPU generator seeded from (seed, offset)
            gens.append(x)
            return torch.Generator().manual_seed(x.initial_seed() ^ (x.get_offset() * 0x9E3779B97F4A7C15 % 2**64))
        return x

    args, kwargs = tree_map(down, (list(args), kwargs))
    for i, arg in enumerate(op._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if arg.is_out and isinstance(value, torch.Tensor) and id(value) in views and not value.numel():
            value = torch.empty(0, dtype=value.dtype)  # the kernel resizes it: a CPU tensor, adopted afterwards
            views[id(value)] = (value, views.pop(id(args[i] if i < len(args) else kwargs[arg.name]))[1])
            adopt.add(id(value))
        elif str(arg.type) == "Optional[Generator]" and value is None:  # random ops draw from the neuron generator
            value = down(_state.generator)
        elif str(arg.type) == "Tensor" and isinstance(value, (bool, int, float)):  # a wrapped number arrives unwrapped
            value = torch.tensor(value)
        else:
            continue
        if i < len(args):
            args[i] = value
        else:
            kwargs[arg.name] = value
    out = op(*args, **kwargs)
    for gen in gens:  # as a Philox generator does: the offset moves past the numbers drawn (rounded up to 4)
        drawn = sum(x.numel() for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor))
        gen.set_offset(gen.get_offset() + (drawn + 3) // 4 * 4)

    def up(x):
        if not isinstance(x, torch.Tensor) or x.device.type != "cpu":
            return x
        if id(x) in views and views[id(x)][0] is x:  # in-place / out=: the neuron argument itself
            return _on(_storage_over(x.untyped_storage()), x, views[id(x)][1]) if id(x) in adopt else views[id(x)][1]
        storage = storages.get(x.untyped_storage().data_ptr()) if x.untyped_storage().data_ptr() else None
        if target[0].type != NAME:  # e.g. _to_copy(device="cpu"): a CPU result, never a view of neuron memory
            return x.clone() if storage is not None else x
        return _on(storage if storage is not None else _storage_over(x.untyped_storage()), x)

    return tree_map(up, out)


def _copy_from(self: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    _host(dst).copy_(_host(self))
    return dst


def _copy_from_and_resize(self: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    _resize_(dst, self.shape)
    return _copy_from(self, dst)


def _resize_(self: torch.Tensor, size, memory_format=None) -> torch.Tensor:
    numel = 1
    for n in size:
        numel *= n
    needed = (self.storage_offset() + numel) * self.element_size() if numel else 0
    if needed > self.untyped_storage().nbytes():
        _resize_storage(self.untyped_storage(), needed)
    return torch.ops.aten.resize_.default.redispatch(_CPU_KEYS, self, size, memory_format=memory_format)


def _histc(self: torch.Tensor, bins: int = 100, min=0, max=0) -> torch.Tensor:
    """The CPU counts floats only; accelerators count integers too (CUDA does, and transformers' grouped experts
    forward counts its int expert ids on every device but the CPU and MPS): integers are counted as floats."""
    if self.is_floating_point():
        return _on_host(_aten.histc.default, self, bins, min, max)
    return torch.histc(self.float(), bins, min, max).to(self.dtype)


def _set_(op):
    return lambda self, *args: op.redispatch(_CPU_KEYS, self, *args)


_aten = torch.ops.aten
_KERNELS = {
    _aten._copy_from.default: _copy_from,
    _aten._copy_from_and_resize.default: _copy_from_and_resize,
    _aten.resize_.default: _resize_,
    _aten.set_.source_Storage: _set_(_aten.set_.source_Storage),
    _aten.set_.source_Storage_storage_offset: _set_(_SET),
    _aten.set_.source_Tensor: _set_(_aten.set_.source_Tensor),
    _aten.set_.default: lambda self: _SET.redispatch(_CPU_KEYS, self, _storage_over(None), 0, (0,), (1,)),
    _aten.record_stream.default: lambda self, stream: None,  # one host-synchronous stream: nothing to record
    _aten.histc.default: _histc,
}


# ---- communication: "neuron_gloo" ------------------------------------------------------------------------------
def _create_backend(store, rank: int, size: int, timeout) -> dist.ProcessGroupGloo:
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _collective(op):
    """c10d's PrivateUse1 kernel for `op`: the CPU kernel on host views, through a group whose CPU backend is the
    neuron group's gloo (a shadow group: the user's group keeps no CPU backend it was not given)."""
    pg_index = [a.name for a in op._schema.arguments].index("process_group")

    def kernel(*args):
        _counts["collectives"] += 1
        _counts[f"collective:{op.__name__}"] += 1
        pg = dist.ProcessGroup.unbox(args[pg_index])
        backend = pg._get_backend(_DEVICE)
        if id(backend) not in _state.shadows:
            shadow = dist.ProcessGroup(pg.rank(), pg.size())
            shadow._register_backend(_CPU, dist.ProcessGroup.BackendType.CUSTOM, backend)
            shadow._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
            _state.shadows[id(backend)] = (backend, shadow)  # keeps `backend` alive, so its id stays unique
        views = {}

        def down(x):
            if isinstance(x, torch.Tensor) and x.device.type == NAME:
                h = _host(x)
                views[id(h)] = (h, x)
                return h
            return x

        args = list(tree_map(down, args))
        args[pg_index] = _state.shadows[id(backend)][1].boxed()
        out = op.redispatch(_CPU_KEYS, *args)
        _keep_until_done(out, [x for _, x in views.values()])
        return tree_map(lambda x: views[id(x)][1] if isinstance(x, torch.Tensor) and id(x) in views else x, out)

    return kernel


def _keep_until_done(out, tensors: list[torch.Tensor]) -> None:
    """Hold `tensors` (a collective's neuron arguments) until its Work completes, as an accelerator's backend keeps
    the tensors of its asynchronous work: gloo holds only the host views, which do not own the memory, so a tensor
    the caller drops while the work runs (`isend(t.contiguous())`) would be freed and reused under gloo's feet.
    Works seen complete are let go at each new collective."""
    works = [dist.Work.unbox(x) for x in tree_flatten(out)[0] if isinstance(x, torch.ScriptObject)]
    _state.in_flight = [(w, held) for w, held in _state.in_flight if not w.is_completed()]
    _state.in_flight += [(w, tensors) for w in works if not w.is_completed()]


# ---- the device module (torch.neuron) -------------------------------------------------------------------------
class Stream(torch.Stream):
    """The device's streams: all work is host-synchronous, so every wait and query is already satisfied."""

    def __new__(cls, device=None, priority: int = 0, **kwargs):
        return super().__new__(cls, device=device or NAME, priority=priority)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event=None):
        return event or Event()


class Event(torch.Event):
    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, **kwargs):
        return super().__new__(cls, device=NAME)

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event) -> float:
        return 0.0


_streams = threading.local()


def current_stream(device=None) -> Stream:
    if getattr(_streams, "current", None) is None:
        _streams.current = Stream()
    return _streams.current


@contextlib.contextmanager
def stream(s: Stream | None):
    previous = current_stream()
    _streams.current = s or previous
    try:
        yield s
    finally:
        _streams.current = previous


def set_device(device) -> None:
    _check_device(torch.device(NAME, device) if isinstance(device, int) else torch.device(device))


class device:  # noqa: N801  (torch.cuda.device's shape: torch.load and storage.to() enter it)
    def __init__(self, device) -> None:
        set_device(device)

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc) -> None:
        pass


def get_rng_state(device=NAME) -> torch.Tensor:
    return _state.generator.get_state()


def set_rng_state(state: torch.Tensor, device=NAME) -> None:
    _state.generator.set_state(state)


def manual_seed(seed: int) -> None:
    _state.generator.manual_seed(int(seed))


def reset_peak_memory_stats(device=None) -> None:
    _Memory.peak = _Memory.current


def _device_module() -> types.ModuleType:
    mod = types.ModuleType(f"torch.{NAME}", "The simulated neuron device (tests/accel/simulated_neuron.py).")
    mod.__dict__.update(
        is_available=lambda: True,
        is_initialized=lambda: True,
        _is_in_bad_fork=lambda: False,
        _lazy_init=lambda: None,
        device_count=lambda: 1,
        current_device=lambda: 0,
        set_device=set_device,
        synchronize=lambda device=None: None,
        get_device_name=lambda device=None: "simulated neuron (host memory)",
        device=device,
        Stream=Stream,
        Event=Event,
        current_stream=current_stream,
        default_stream=current_stream,
        stream=stream,
        manual_seed=manual_seed,
        manual_seed_all=manual_seed,
        seed=lambda: _state.generator.seed(),
        seed_all=lambda: _state.generator.seed(),
        initial_seed=lambda: _state.generator.initial_seed(),
        get_rng_state=get_rng_state,
        set_rng_state=set_rng_state,
        get_rng_state_all=lambda: [get_rng_state()],
        set_rng_state_all=lambda states: set_rng_state(states[0]),
        memory_allocated=lambda device=None: _Memory.current,
        max_memory_allocated=lambda device=None: _Memory.peak,
        memory_reserved=lambda device=None: _Memory.current,
        max_memory_reserved=lambda device=None: _Memory.peak,
        reset_peak_memory_stats=reset_peak_memory_stats,
        empty_cache=lambda: None,
        is_bf16_supported=lambda including_emulation=True: True,
        get_amp_supported_dtype=lambda: [torch.float16, torch.bfloat16],
    )
    return mod


# ---- autocast: torch.autocast("neuron") casts as on CUDA, for the ops that matter here -------------------------
_LOWER_PRECISION = "matmul mm mv bmm addmm addmv addr baddbmm addbmm linear prelu conv1d conv2d conv3d convolution"
_FP32 = "softmax log_softmax layer_norm group_norm nll_loss cross_entropy_loss mse_loss"


def _autocast(op, to_fp32: bool):
    def kernel(*args, **kwargs):
        dtype = torch.float32 if to_fp32 else torch.get_autocast_dtype(NAME)

        def cast(x):
            eligible = isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64
            return x.to(dtype) if eligible and x.device.type == NAME else x

        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)):
            return op(*tree_map(cast, args), **tree_map(cast, kwargs))

    return kernel


def _register_autocast(lib: torch.library.Library) -> None:
    for names, to_fp32 in ((_LOWER_PRECISION, False), (_FP32, True)):
        for name in names.split():
            packet = getattr(torch.ops.aten, name)
            for op in (getattr(packet, overload) for overload in packet.overloads()):
                lib.impl(op, _autocast(op, to_fp32), "AutocastPrivateUse1")


# ---- what the ecosystem sees: TorchNeuron's package ------------------------------------------------------------
def _announce_package() -> None:
    """accelerate (MULTI_NEURON, `torch.device("neuron")` for the Trainer) and transformers tell TorchNeuron by its
    package being there (`importlib.util.find_spec("torch_neuronx")`), then ask `torch.neuron`: a module that holds
    nothing stands for it (an existing one, the real package, is left alone)."""
    import importlib.machinery
    import importlib.util
    import sys

    if "torch_neuronx" in sys.modules or importlib.util.find_spec("torch_neuronx") is not None:
        return
    package = types.ModuleType("torch_neuronx", "Stands for TorchNeuron's package (tests/accel/simulated_neuron.py).")
    package.__spec__ = importlib.machinery.ModuleSpec("torch_neuronx", None)
    package.__version__ = "0.0.0+simulated"
    sys.modules["torch_neuronx"] = package


# ---- installation ---------------------------------------------------------------------------------------------
def _load_cpp():
    """The C++ hooks, built once per machine (~10 s); None (pure-Python device) when they cannot be built."""
    if os.environ.get("NEURON_SIM_PURE_PYTHON") == "1":
        return None
    try:
        from torch.utils import cpp_extension

        build_dir = os.path.join(_EXT_DIR, torch.__version__)
        os.makedirs(build_dir, exist_ok=True)
        lock = os.path.join(build_dir, "lock")  # left behind by a killed build, torch would wait on it forever
        if os.path.exists(lock) and time.time() - os.path.getmtime(lock) > 300:
            os.remove(lock)
        source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "neuron_hooks.cpp")
        return cpp_extension.load("neuron_hooks", [source], build_directory=build_dir, extra_cflags=["-O1"])
    except Exception as e:  # no compiler, no headers: the pure-Python path below covers all but the hooks
        warnings.warn(f"simulated neuron: C++ hooks not built ({type(e).__name__}: {e}); pure Python", stacklevel=2)
        return None


def _fall_through_autograd() -> None:
    """torch 2.9 has an autograd fallback for the built-in devices only ('Could not run c10d::broadcast_ with
    arguments from the Autogradneuron backend'); 2.13 for PrivateUse1 too. Ops without an autograd kernel of their
    own (the collectives) then pass through autograd, as on the CPU."""
    if torch._C._dispatch_has_backend_fallback(torch._C.DispatchKey.AutogradPrivateUse1):
        return
    library = torch.library.Library("_", "IMPL")
    library.fallback(torch.library.fallthrough_kernel, "AutogradPrivateUse1")
    _state.libs.append(library)


def install() -> None:
    """Makes `neuron` a device of this process (idempotent; call it in every process before any neuron tensor)."""
    global _DEVICE
    if _state.installed:
        return
    import sys

    torch.utils.rename_privateuse1_backend(NAME)
    _DEVICE = torch.device(NAME, 0)
    torch.utils.generate_methods_for_privateuse1_backend()
    torch._register_device_module(NAME, _device_module())
    _state.cpp = _load_cpp()
    if _state.cpp is not None:
        _state.cpp.install(sys.modules[__name__])
        _state.generator = _state.cpp.default_generator()
    else:  # what Python can register: no generators, pinned memory, neuron:1 check in torch.accelerator
        from torch.utils.backend_registration import _DummyDeviceGuard, _DummyPrivateUse1Hook

        torch._C._acc.register_python_privateuseone_hook(_DummyPrivateUse1Hook())
        torch._C._acc.register_python_privateuseone_device_guard(_DummyDeviceGuard())
        _state.generator = torch.Generator()  # a CPU generator: random ops run on host views anyway
        _patch_untyped_storage()
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(_fallback, "PrivateUse1")
    fallback.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    aten = torch.library.Library("aten", "IMPL")
    for name in torch._C._dispatch_get_all_op_names():  # ops whose CPU kernel would lose to a decomposition
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        if name.startswith("aten::") and has(name, "CPU") and has(name, "CompositeImplicitAutograd"):
            packet, _, overload = name[6:].partition(".")
            op = getattr(getattr(torch.ops.aten, packet), overload or "default")
            aten.impl(name[6:], lambda *args, op=op, **kwargs: _fallback(op, *args, **kwargs), "PrivateUse1")
    c10d = torch.library.Library("c10d", "IMPL")
    with warnings.catch_warnings():  # replacing c10d's own PrivateUse1 kernels is the point
        warnings.simplefilter("ignore")
        for name in torch._C._dispatch_get_registrations_for_dispatch_key("PrivateUse1"):
            if name.startswith("c10d::"):
                c10d.impl(name[6:], _collective(getattr(torch.ops.c10d, name[6:]).default), "PrivateUse1")
    _register_autocast(aten)
    _state.libs = [fallback, aten, c10d]
    _fall_through_autograd()
    dist.Backend.register_backend(BACKEND, _create_backend, devices=[NAME])
    _announce_package()
    _state.installed = True
