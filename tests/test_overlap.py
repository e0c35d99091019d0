"""Overlap mode: the optimizers' tensors are copied while training goes on, and the checkpoint is
still, bit for bit, the state at the moment of the call.

Real training throughout (BatchNorm in train mode, Adam and SGD with momentum, a plain tensor and
a parameter outside every optimizer, all changed in place). The background copy function is
replaced by one that waits for a gate (fault injection) so that the next forward, backward and
``step()`` really happen while the copies are pending, and the tests can tell that the step was
held back.
"""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import pytest
import torch

import stashpoint
from dist_util import run_world
from stashpoint._core.naming import MANIFEST_NAME
from stashpoint._save import overlap as _overlap
from stashpoint._save.job import Layout
from stashpoint._state.tree import flatten

BIG = 2048  # ~84 MB of state: weights, BatchNorm statistics, Adam moments, SGD momentum


class Net(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(width, width)
        self.bn = torch.nn.BatchNorm1d(width)
        self.fc2 = torch.nn.Linear(width, width)
        self.gain = torch.nn.Parameter(torch.ones(width), requires_grad=False)  # in no optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x)))) * self.gain


def make_training(width: int, seed: int = 0, device: str = "cpu") -> dict:
    torch.manual_seed(seed)
    model = Net(width).to(device)
    adam = torch.optim.Adam(list(model.fc1.parameters()) + list(model.bn.parameters()), lr=1e-3)
    sgd = torch.optim.SGD(model.fc2.parameters(), lr=1e-2, momentum=0.9)
    return {"model": model, "adam": adam, "sgd": sgd, "ema": torch.zeros(width, device=device), "step": 0}


def forward_backward(state: dict, i: int) -> None:
    """The part of a training step before the optimizers' step(): changes BatchNorm statistics,
    the parameter outside the optimizers and the plain tensor in place."""
    model = state["model"]
    width = model.gain.numel()
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(16, width, generator=g).to(model.gain.device)
    model(x).pow(2).mean().backward()
    with torch.no_grad():
        model.gain.mul_(0.99)
        state["ema"].mul_(0.9).add_(model.fc2.weight[0], alpha=0.1)


def optimizer_steps(state: dict) -> None:
    for name in ("adam", "sgd"):
        state[name].step()
        state[name].zero_grad()
    state["step"] += 1


def train_step(state: dict, i: int) -> None:
    forward_backward(state, i)
    optimizer_steps(state)


def snapshot(state: dict) -> dict:
    """A deep copy of everything the checkpoint holds."""
    return copy.deepcopy(
        {
            "model": state["model"].state_dict(),
            "adam": state["adam"].state_dict(),
            "sgd": state["sgd"].state_dict(),
            "ema": state["ema"],
            "step": state["step"],
        }
    )


def loaded(path: Path, width: int, device: str = "cpu") -> dict:
    """The checkpoint at ``path``, loaded into fresh objects."""
    fresh = make_training(width, seed=99, device=device)
    fresh["ema"].fill_(-1.0)
    fresh["step"] = -1
    stashpoint.load(fresh, path)
    return snapshot(fresh)


def leaves(obj: object, where: str = "") -> dict[str, object]:
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in leaves(val, f"{where}/{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, val in enumerate(obj) for k, v in leaves(val, f"{where}/{i}").items()}
    return {where: obj}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise(got: dict, want: dict) -> None:
    a, b = leaves(got), leaves(want)
    assert a.keys() == b.keys()
    for key, x in a.items():
        y = b[key]
        if isinstance(y, torch.Tensor):
            assert isinstance(x, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape, key
            assert torch.equal(_bits(x), _bits(y)), f"{key} is not the value at the time of the call"
        else:
            assert x == y, key


def changed_tensors(now: dict, then: dict) -> set[str]:
    a, b = leaves(now), leaves(then)
    return {k for k, v in b.items() if isinstance(v, torch.Tensor) and not torch.equal(_bits(a[k]), _bits(v))}


def tensor_keys(snap: dict) -> set[str]:
    return {k for k, v in leaves(snap).items() if isinstance(v, torch.Tensor)}


def step_hooks(state: dict) -> int:
    return len(state["adam"]._optimizer_step_pre_hooks) + len(state["sgd"]._optimizer_step_pre_hooks)


class Gate:
    """Fault injection: the background copies start only once ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    def release_after(self, seconds: float) -> None:
        timer = threading.Timer(seconds, self.release.set)
        timer.daemon = True
        timer.start()


@pytest.fixture
def gate(monkeypatch):
    g = Gate()
    copies = _overlap.copy_deferred

    def gated(triples):
        g.entered.set()
        if not g.release.wait(60):
            raise TimeoutError("the test never released the gate")
        copies(triples)

    monkeypatch.setattr(_overlap, "copy_deferred", gated)
    yield g
    g.release.set()


def test_the_checkpoint_is_the_state_at_the_call_while_training_goes_on(tmp_path, gate):
    state = make_training(BIG)
    for i in range(2):
        train_step(state, i)
    ref = snapshot(state)
    assert sum(t.numel() * t.element_size() for t in leaves(ref).values() if isinstance(t, torch.Tensor)) > 50e6

    h = stashpoint.async_save(state, tmp_path / "ck", overlap=True)
    assert gate.entered.wait(30), "the background copies started"
    assert not h.staged() and step_hooks(state) == 2
    forward_backward(state, 2)  # BatchNorm statistics, the gain and the plain tensor change now
    assert not h.staged(), "forward and backward ran while the copies were pending"
    gate.release_after(0.3)
    t0 = time.perf_counter()
    state["adam"].step()  # held back until every copy is done
    held = time.perf_counter() - t0
    assert h.staged(), "the step ran only once the copies were done"
    assert held >= 0.2
    state["sgd"].step()
    for name in ("adam", "sgd"):
        state[name].zero_grad()
    for i in range(3, 6):
        train_step(state, i)

    stats = h.wait(timeout=120)
    assert step_hooks(state) == 0
    assert stats.step_wait_s >= 0.2, "the hook's wait is reported"
    assert stats.staged_s > stats.blocking_s and stats.staged_s >= 0.3
    assert changed_tensors(snapshot(state), ref) == tensor_keys(ref), "training changed every tensor since"
    assert_bitwise(loaded(tmp_path / "ck", BIG), ref)


def test_what_is_copied_before_returning_and_what_later(tmp_path):
    state = make_training(8)
    train_step(state, 0)
    state["extra"] = {"plain": torch.ones(3)}
    state["adam"].param_groups[0]["lr"] = torch.tensor(1e-3)  # a scheduler changes it in place
    _, tensors = flatten(state)
    layout = Layout.of(tensors)
    triples = [(k, t, torch.empty_like(t)) for k, t in layout.sources.items()]
    eager, deferred = _overlap.split(triples, _overlap.optimizers_in(state))
    eager_keys = {k for k, _, _ in eager}
    late_keys = {k for k, _, _ in deferred}
    buffers = {f"model/bn.{b}" for b in ("running_mean", "running_var", "num_batches_tracked")}
    assert eager_keys == buffers | {"model/gain", "ema", "extra/plain", "adam/param_groups/0/lr"}
    params = {f"model/{m}.{p}" for m in ("fc1", "bn", "fc2") for p in ("weight", "bias")}
    adam = {
        f"adam/state/{m}.{p}/{s}"
        for m in ("fc1", "bn")
        for p in ("weight", "bias")
        for s in ("step", "exp_avg", "exp_avg_sq")
    }
    sgd = {f"sgd/state/fc2.{p}/momentum_buffer" for p in ("weight", "bias")}
    assert late_keys == params | adam | sgd
    assert _overlap.split(triples, [])[1] == [], "without an optimizer in the state nothing is deferred"
    with_layout = _overlap.split(triples, _overlap.optimizers_in(state), layout)
    assert [[k for k, _, _ in part] for part in with_layout] == [[k for k, _, _ in part] for part in (eager, deferred)]


def test_the_split_is_remembered_per_structure_and_made_again_when_the_optimizers_change():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    both = torch.optim.SGD(model.parameters(), lr=0.1)  # no state tensors: the layout stays the same
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    _, tensors = flatten({"model": model})
    layout = Layout.of(tensors)
    triples = [(k, t, torch.empty_like(t)) for k, t in layout.sources.items()]
    late = {k for k, _, _ in _overlap.split(triples, [both], layout)[1]}
    assert late == {"model/0.weight", "model/0.bias", "model/1.weight", "model/1.bias"}
    assert len(layout.memo) == 1
    again = {k for k, _, _ in _overlap.split(triples, [both], layout)[1]}
    assert again == late and len(layout.memo) == 1, "the second save of the structure reuses it"
    late = {k for k, _, _ in _overlap.split(triples, [first], layout)[1]}
    assert late == {"model/0.weight", "model/0.bias"}, "another optimizer: made again, layer 1 copied at once"
    both.param_groups[0]["params"] = both.param_groups[0]["params"][:2]  # the same optimizer holds less
    late = {k for k, _, _ in _overlap.split(triples, [both], layout)[1]}
    assert late == {"model/0.weight", "model/0.bias"}


def test_without_an_optimizer_everything_is_copied_before_returning(tmp_path):
    model = Net(16)
    state = {"model": model, "t": torch.arange(10.0)}
    before = model.fc1.weight.detach().clone()
    h = stashpoint.async_save(state, tmp_path / "ck", overlap=True)
    assert h.staged()
    with torch.no_grad():
        model.fc1.weight.add_(1.0)
    h.wait()
    fresh = {"model": Net(16), "t": torch.zeros(10)}
    stashpoint.load(fresh, tmp_path / "ck")
    assert torch.equal(fresh["model"].fc1.weight, before)
    stats = stashpoint.save(state, tmp_path / "ck2", overlap=True)  # save() passes it through
    assert stats.step_wait_s == 0.0 and stats.bytes_written > 0


def test_a_failed_background_copy_fails_the_save_and_leaves_nothing_behind(tmp_path, monkeypatch):
    state = make_training(64)
    train_step(state, 0)

    def broken(triples):
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(_overlap, "copy_deferred", broken)
    h = stashpoint.async_save(state, tmp_path / "bad", overlap=True)
    for i in range(1, 3):  # the hooks neither raise nor hang
        train_step(state, i)
    with pytest.raises(stashpoint.CheckpointError, match="injected copy failure") as err:
        h.wait(timeout=60)
    assert str(tmp_path / "bad") in str(err.value)
    assert not (tmp_path / "bad" / MANIFEST_NAME).exists()
    assert step_hooks(state) == 0

    monkeypatch.undo()
    ref = snapshot(state)
    h = stashpoint.async_save(state, tmp_path / "good", overlap=True)
    train_step(state, 3)
    h.wait(timeout=60)
    assert_bitwise(loaded(tmp_path / "good", 64), ref)


def test_an_exception_in_training_before_the_next_step_leaves_no_hook(tmp_path, gate):
    state = make_training(64)
    train_step(state, 0)
    ref = snapshot(state)
    h = stashpoint.async_save(state, tmp_path / "ck", overlap=True)
    with pytest.raises(ValueError, match="bad batch"):
        forward_backward(state, 1)
        raise ValueError("bad batch")  # the training code fails: no step() follows
    assert step_hooks(state) == 2
    gate.release.set()
    deadline = time.monotonic() + 30
    while not h.staged() and time.monotonic() < deadline:  # no stashpoint call in between
        time.sleep(0.01)
    assert h.staged()
    assert step_hooks(state) == 0, "the hooks were removed when the copies ended"
    h.wait(timeout=60)
    assert_bitwise(loaded(tmp_path / "ck", 64), ref)


def test_two_consecutive_overlapped_saves(tmp_path, gate):
    state = make_training(256)
    train_step(state, 0)
    ref_a = snapshot(state)
    ha = stashpoint.async_save(state, tmp_path / "a", overlap=True)
    forward_backward(state, 1)
    ref_b = snapshot(state)
    gate.release_after(0.3)
    t0 = time.perf_counter()
    hb = stashpoint.async_save(state, tmp_path / "b", overlap=True)  # waits for a's copies first
    assert time.perf_counter() - t0 >= 0.2 and ha.staged()
    optimizer_steps(state)
    for i in range(2, 4):
        train_step(state, i)
    ha.wait(timeout=60)
    hb.wait(timeout=60)
    assert step_hooks(state) == 0
    assert changed_tensors(ref_b, ref_a), "the two saves hold different states"
    assert_bitwise(loaded(tmp_path / "a", 256), ref_a)
    assert_bitwise(loaded(tmp_path / "b", 256), ref_b)


def test_in_place_changes_outside_step_after_wait_staged(tmp_path, gate):
    state = make_training(64)
    train_step(state, 0)
    ref = snapshot(state)
    h = stashpoint.async_save(state, tmp_path / "ck", overlap=True)
    gate.release_after(0.2)
    h.wait_staged(timeout=30)  # what an EMA or a manual update must do first
    assert h.staged()
    with torch.no_grad():
        state["model"].fc1.weight.mul_(0.5)  # held by an optimizer, changed outside step()
        next(iter(state["adam"].state.values()))["exp_avg"].zero_()
    h.wait(timeout=60)
    assert_bitwise(loaded(tmp_path / "ck", 64), ref)


def test_a_user_hook_registered_after_ours_keeps_working(tmp_path, gate):
    state = make_training(64)
    train_step(state, 0)
    ref = snapshot(state)
    h = stashpoint.async_save(state, tmp_path / "ck", overlap=True)
    calls = []
    user = state["adam"].register_step_pre_hook(lambda *args: calls.append(1))
    gate.release_after(0.2)
    for i in range(1, 4):
        train_step(state, i)  # torch iterates the hooks live: ours must not remove itself mid-loop
    assert calls == [1, 1, 1]
    h.wait(timeout=60)
    assert len(state["adam"]._optimizer_step_pre_hooks) == 1, "ours is gone, the user's stays"
    user.remove()
    assert step_hooks(state) == 0
    assert_bitwise(loaded(tmp_path / "ck", 64), ref)


def test_overlap_through_the_manager(tmp_path, gate):
    state = make_training(256)
    train_step(state, 0)
    with stashpoint.CheckpointManager(tmp_path / "run", keep_last=None) as mgr:
        state["step"] = 1
        ref = snapshot(state)
        h = mgr.save(1, state, overlap=True)
        assert gate.entered.wait(30), "the background copies started"
        gate.release_after(0.2)  # from here: the steps below must wait (released earlier, a fast
        for i in range(1, 4):  # machine had the copies done before the first step)
            train_step(state, i)
        mgr.wait()
        assert h.stats is not None and h.stats.step_wait_s > 0
    fresh = make_training(256, seed=5)
    with stashpoint.CheckpointManager(tmp_path / "run") as mgr:
        assert mgr.restore(fresh) == 1
    assert_bitwise(snapshot(fresh), ref)


def test_two_ranks_overlap_independently(tmp_path):
    worker = Path(__file__).with_name("overlap_worker.py")
    results = run_world(2, str(tmp_path / "ck"), timeout=240, worker=worker)
    for r in results:
        assert r["same"], "each rank loads exactly the state at the call"
        assert r["changed"], "training went on after the call"
        assert not r["staged_at_call"] and r["staged_after_step"]
        assert r["step_wait_s"] > 0 and r["first_step_s"] >= 0.2
        assert r["hooks_left"] == 0
    assert (tmp_path / "ck" / MANIFEST_NAME).exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_training_goes_on_during_the_copies(tmp_path):
    state = make_training(BIG, device="cuda")
    for i in range(2):
        train_step(state, i)
    ref = snapshot(state)
    h = stashpoint.async_save(state, tmp_path / "ck", overlap=True)
    for i in range(2, 8):
        train_step(state, i)
    stats = h.wait(timeout=120)
    assert step_hooks(state) == 0
    assert stats.staged_s >= stats.blocking_s
    assert changed_tensors(snapshot(state), ref) == tensor_keys(ref)
    assert_bitwise(loaded(tmp_path / "ck", BIG, device="cuda"), ref)


def test_load_into_the_same_objects_waits_for_the_pending_copies(tmp_path, gate):
    torch.manual_seed(0)
    model = torch.nn.Linear(200, 200)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 200)).sum().backward()
    opt.step()
    stashpoint.save({"model": model, "optim": opt}, tmp_path / "other")
    want = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    at_call = [p.detach().clone() for p in model.parameters()]
    h = stashpoint.async_save({"model": model, "optim": opt}, tmp_path / "ck", overlap=True)
    assert gate.entered.wait(30), "the background copies started"
    gate.release_after(0.3)
    stashpoint.load({"model": model, "optim": opt}, tmp_path / "other")  # must wait for the copies
    h.wait()
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), want))
    m2 = torch.nn.Linear(200, 200)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
    stashpoint.load({"model": m2, "optim": o2}, tmp_path / "ck")
    assert all(torch.equal(p, w) for p, w in zip(m2.parameters(), at_call)), "the save kept the values at its call"
