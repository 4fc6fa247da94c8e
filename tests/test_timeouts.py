"""Timeouts that tell a slow rank from a dead one (mesh/timeouts.py), and the device set-up of mesh/device.py and
mesh/rendezvous.py that needs no accelerator to check: argument errors, the switch from the init timeout to the
train timeout at the first optimizer step and back around saves and loads (on real gloo processes), the device index
each process picks, one device claimed by two ranks, the warning when an accelerator build falls back to the CPU,
and `collective_device` from a group's backend string. The slow cases (a rank 75 s late, a killed rank) are in
test_hosts.py."""

from __future__ import annotations

import math
import threading
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from optimum_parallel.mesh import device as devices
from optimum_parallel.mesh import rendezvous, timeouts
from optimum_parallel.mesh.timeouts import INIT_TIMEOUT, TRAIN_TIMEOUT, WATCHED_TIMEOUT, Timeouts

WORLD_SIZE = 2
S = timedelta(seconds=1)


# ---- arguments -----------------------------------------------------------------------------------------------
def test_defaults_are_long_until_training_then_short():
    assert Timeouts.of() == Timeouts(INIT_TIMEOUT, TRAIN_TIMEOUT)
    assert INIT_TIMEOUT >= timedelta(minutes=10) > TRAIN_TIMEOUT
    assert Timeouts.of(30) == Timeouts(30 * S, 30 * S)  # a short timeout (tests) is short in both phases
    assert Timeouts.of(timedelta(minutes=30)) == Timeouts(timedelta(minutes=30), TRAIN_TIMEOUT)
    assert Timeouts.of(900, train_timeout=45.5) == Timeouts(900 * S, timedelta(seconds=45.5))
    assert Timeouts.of(Timeouts(100 * S, 20 * S)) == Timeouts(100 * S, 20 * S)


def test_with_the_heartbeat_collectives_wait_long_in_every_phase():
    """The heartbeat decides death (mesh/heartbeat.py): 30 minutes everywhere unless the caller says otherwise."""
    assert Timeouts.of(watched=True) == Timeouts(WATCHED_TIMEOUT, WATCHED_TIMEOUT) and WATCHED_TIMEOUT >= INIT_TIMEOUT
    assert Timeouts.of(1800, watched=True) == Timeouts(1800 * S, 1800 * S)  # the Trainer's ddp_timeout, kept after
    assert Timeouts.of(30, train_timeout=7, watched=True) == Timeouts(30 * S, 7 * S)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"timeout": 0}, "timeout=0"),
        ({"timeout": -5}, "timeout=-5"),
        ({"timeout": math.nan}, "timeout=nan"),
        ({"timeout": "60"}, "timeout='60'"),
        ({"timeout": True}, "timeout=True"),
        ({"timeout": timedelta(0)}, "timeout=datetime.timedelta(0)"),
        ({"train_timeout": 0}, "train_timeout=0"),
        ({"timeout": 60, "train_timeout": -1}, "train_timeout=-1"),
        ({"timeout": Timeouts(60 * S, timedelta(0))}, "timeout.train="),
        ({"timeout": Timeouts(60 * S, 10 * S), "train_timeout": 5}, "train_timeout inside the Timeouts"),
    ],
)
def test_bad_timeout_raises_naming_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key.replace("(", r"\(").replace(")", r"\)")):
        Timeouts.of(**kwargs)


def test_init_mesh_rejects_a_bad_timeout_before_starting_anything():
    import optimum_parallel as op

    for kwargs, key in [({"timeout": 0}, "timeout=0"), ({"train_timeout": -1}, "train_timeout=-1")]:
        with pytest.raises(ValueError, match=key):
            op.init_mesh(tp=1, **kwargs)
        assert not dist.is_initialized()


@pytest.mark.parametrize("value", [0, -1, float("nan")])
def test_trainer_ddp_timeout_must_be_positive(value):
    from optimum_parallel.integrations.transformers.training_args import check_ddp_timeout

    with pytest.raises(ValueError, match=r"ddp_timeout=.*> 0"):
        check_ddp_timeout(value)
    check_ddp_timeout(1800)


# ---- the switch, on real processes -----------------------------------------------------------------------------
def _group_timeouts(mesh) -> dict[str, float]:
    groups = {"world": dist.group.WORLD, **{dim: mesh.group(dim) for dim in ("tp", "dp")}}
    return {name: timeouts.group_timeout(group).total_seconds() for name, group in groups.items()}


def _switch_on_every_rank() -> dict:
    import optimum_parallel as op
    from optimum_parallel.checkpoint import save as checkpoint_save

    mesh = op.init_mesh(tp=2, timeout=50, train_timeout=7)
    seen = {"made": _group_timeouts(mesh), "training_before": timeouts.is_training()}
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    param.grad = torch.ones(2)
    optimizer.step()  # the first step ends: the train timeout everywhere
    seen["after_first_step"] = _group_timeouts(mesh)
    late = mesh.group_of("tp", [0, 1])  # a group made in training gets the train timeout too
    seen["late_group"] = timeouts.group_timeout(late).total_seconds()
    with timeouts.long_running("a test"):
        seen["long_running"] = _group_timeouts(mesh)
        with timeouts.long_running("nested"):
            pass
        seen["nested_exit"] = _group_timeouts(mesh)["tp"]
    seen["after_long"] = _group_timeouts(mesh)
    original, inside = checkpoint_save.plan_save, {}

    def plan_save(*args, **kwargs):  # what the save sees, then out
        inside.update(_group_timeouts(mesh))
        raise InterruptedError

    checkpoint_save.plan_save = plan_save
    try:
        checkpoint_save.save_model_checkpoint(torch.nn.Linear(1, 1), "unused")
    except InterruptedError:
        pass
    finally:
        checkpoint_save.plan_save = original
    seen["inside_save"] = inside
    x = torch.ones(3)
    dist.all_reduce(x, group=mesh.group("tp"))  # the groups still work
    seen["sum"] = x.tolist()
    op.init_mesh(tp=2, timeout=50, train_timeout=7)  # a new mesh starts over: init timeout until its first step
    seen["new_mesh"] = timeouts.current().total_seconds()
    return seen


def test_init_timeout_until_the_first_step_then_train_timeout(pool):
    for seen in pool.run(_switch_on_every_rank):
        init = {"world": 50.0, "tp": 50.0, "dp": 50.0}
        train = {"world": 7.0, "tp": 7.0, "dp": 7.0}
        assert seen["made"] == init and not seen["training_before"]
        assert seen["after_first_step"] == train and seen["late_group"] == 7.0
        assert seen["long_running"] == init and seen["nested_exit"] == 50.0
        assert seen["after_long"] == train and seen["inside_save"] == init
        assert seen["sum"] == [2.0] * 3 and seen["new_mesh"] == 50.0


# ---- devices -----------------------------------------------------------------------------------------------------
@pytest.fixture
def fake_accelerator(monkeypatch):
    """torch.accelerator answering for `count` devices; records set_device_index."""
    chosen: list[int] = []

    def use(count: int):
        monkeypatch.setattr(torch.accelerator, "device_count", lambda: count)
        monkeypatch.setattr(torch.accelerator, "set_device_index", chosen.append)
        monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: chosen[-1] if chosen else 0)
        return chosen

    return use


@pytest.mark.parametrize(("count", "local_rank", "index"), [(1, "1", 0), (1, "3", 0), (4, "1", 1), (4, "3", 3)])
def test_each_process_sets_its_device_index(fake_accelerator, monkeypatch, count, local_rank, index):
    chosen = fake_accelerator(count)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert devices.set_process_device("cuda") == torch.device("cuda", index)
    assert chosen == [index]
    assert devices.set_process_device("cpu") is None and chosen == [index]
    assert devices.set_process_device("cuda", bound=torch.device("cuda", 0)) == torch.device("cuda", 0)


def _claims(identities: dict[int, str], local_world: int) -> dict[int, str | None]:
    """Each rank (a thread) posts its device in one store; what each raised (None: nothing)."""
    store, raised = dist.HashStore(), {}

    def rank(r: int) -> None:
        try:
            with pytest.MonkeyPatch.context() as m:
                m.setattr(devices, "device_identity", lambda device: identities[device.index])
                rendezvous.check_one_rank_per_device(store, r, torch.device("cuda", r), 10 * S, r, local_world)
            raised[r] = None
        except RuntimeError as err:
            raised[r] = str(err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in identities]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return raised


def test_two_local_ranks_on_one_device_raise_on_each_naming_them():
    raised = _claims({0: "cuda GPU-aaaa", 1: "cuda GPU-aaaa", 2: "cuda GPU-bbbb"}, 3)
    assert raised[2] is not None and raised == {r: raised[2] for r in range(3)}
    assert "ranks 0, 1 on" in raised[0] and "cuda GPU-aaaa" in raised[0] and "GPU-bbbb" not in raised[0]
    assert _claims({0: "cuda GPU-aaaa", 1: "cuda GPU-bbbb"}, 2) == {0: None, 1: None}
    assert not devices.shares_devices("nccl") and devices.shares_devices("gloo")


def test_accelerator_build_falling_back_to_the_cpu_warns_with_the_reason(monkeypatch):
    answers = {True: None, False: torch.device("cuda")}
    monkeypatch.setattr(
        torch.accelerator, "current_accelerator", lambda check_available=False: answers[check_available]
    )
    monkeypatch.setattr(devices, "_WARNED", [])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.warns(UserWarning, match=r"built for cuda but .*CUDA_VISIBLE_DEVICES='' hides every device.*CPU"):
        assert devices.resolve_device_type() == "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        devices.current_accelerator()  # once per process
    monkeypatch.setattr(devices, "_WARNED", [])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.warns(UserWarning, match=r"cannot use it \((\w+Error: .+|0 devices visible)\)"):
        devices.current_accelerator()


def test_collective_device_from_the_backend_string(monkeypatch):
    assert devices.device_for_backend("gloo") == torch.device("cpu")
    assert devices.device_for_backend("cpu:gloo,cuda:nccl") == torch.device("cpu")  # no GPU in this process
    for bad in ("undefined", "nccl", "gloo,bogus"):
        with pytest.raises(ValueError, match="backend"):
            devices.device_for_backend(bad)
    monkeypatch.setattr(devices, "current_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(devices, "current_device", lambda kind=None: torch.device("cuda", 3))
    assert devices.device_for_backend("cpu:gloo,cuda:nccl") == torch.device("cuda", 3)
    assert devices.device_for_backend("nccl") == torch.device("cuda", 3)
    assert devices.device_for_backend("gloo") == torch.device("cpu")  # gloo's collectives take host tensors


@pytest.fixture
def fresh_timeouts():
    """This process's timeout state, restored after the test (the hooks stay registered: they are global)."""
    state = timeouts._STATE
    saved = (state.timeouts, state.training, state.long)
    yield
    state.timeouts, state.training, state.long = saved


def test_a_compile_in_training_runs_under_the_init_timeout(fresh_timeouts):
    import torch._dynamo  # noqa: F401  (imported: the compile callbacks are registered)

    timeouts.configure(Timeouts(50 * S, 7 * S))
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    param.grad = torch.ones(2)
    optimizer.step()
    assert timeouts.is_training() and timeouts.current() == 7 * S
    seen = []

    def backend(graph, example_inputs):  # runs while dynamo compiles
        seen.append(timeouts.current())
        return graph.forward

    compiled = torch.compile(lambda x: x * 2 + 1, backend=backend)
    assert compiled(torch.ones(3)).tolist() == [3.0] * 3
    assert seen == [50 * S] and timeouts.current() == 7 * S
