"""A save's call or its background work meeting the rest of a program: an optimizer wrapper
whose step hooks cannot be registered, a failure or Ctrl-C half-way through overlap mode's
hand-over, a fork while copies are pending (DataLoader workers), a signal to the writer
process's group while it starts, a Ctrl-C between the call lock's acquire and its owner."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import stashpoint
from stashpoint._save import overlap as _overlap
from stashpoint._save import writerproc
from stashpoint._save.calllock import CallLock
from stashpoint._save.engine import get_engine
from test_overlap import gate, make_training, snapshot, train_step  # noqa: F401 - gate: the fixture

pytestmark = pytest.mark.timeout(120)  # a regression here hangs: fail instead


class Wrapped(torch.optim.Optimizer):
    """An optimizer wrapper that never runs ``Optimizer.__init__``, as Accelerate's
    ``AcceleratedOptimizer`` and torch's ``PostLocalSGDOptimizer`` do: no step hooks of its own."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def state(self):  # type: ignore[override]
        return self.optimizer.state

    @property
    def param_groups(self):  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def defaults(self):  # type: ignore[override]
        return self.optimizer.defaults

    def state_dict(self):  # type: ignore[override]
        return self.optimizer.state_dict()

    def load_state_dict(self, sd):  # type: ignore[override]
        self.optimizer.load_state_dict(sd)

    def step(self, closure=None):  # type: ignore[override]
        return self.optimizer.step(closure)


def test_a_wrapped_optimizer_is_held_back_through_the_optimizer_it_wraps(tmp_path, gate):  # noqa: F811
    """Before: registering the wrapper's hook raised AttributeError half-way through the hand-over;
    the copies it left registered never ran and every later save, load and step() hung."""
    state = make_training(64)
    train_step(state, 0)
    state["adam"] = Wrapped(state["adam"])
    ref = snapshot(state)
    handle = stashpoint.async_save(state, tmp_path / "ck", overlap=True)
    assert gate.entered.wait(30)
    gate.release_after(0.3)
    state["adam"].step()  # held back, through the inner optimizer's hook, until the copies are done
    assert handle.staged()
    handle.wait(timeout=60)
    back = make_training(64, seed=1)
    back["adam"] = Wrapped(back["adam"])
    stashpoint.load(back, tmp_path / "ck")
    assert torch.equal(back["model"].fc1.weight, ref["model"]["fc1.weight"])


def test_a_failure_while_the_copies_are_handed_over_leaves_nothing_waiting(tmp_path, monkeypatch):
    """A hook refused (or a Ctrl-C) after the copies were registered: the call raises, and the
    next step(), save and load run. Before: each of them waited for ever."""
    state = make_training(64)
    train_step(state, 0)
    real = _overlap._StepGuard.__init__
    made = []

    def second_refused(self, optim, pending):  # type: ignore[no-untyped-def]
        made.append(optim)
        if len(made) == 2:
            raise KeyboardInterrupt  # as a Ctrl-C landing in the hand-over
        real(self, optim, pending)

    monkeypatch.setattr(_overlap._StepGuard, "__init__", second_refused)
    with pytest.raises(KeyboardInterrupt):
        stashpoint.async_save(state, tmp_path / "a", overlap=True)
    monkeypatch.undo()
    assert all(len(o._optimizer_step_pre_hooks) == 0 for o in (state["adam"], state["sgd"])), "no hook left"
    train_step(state, 1)  # the optimizers step
    stashpoint.save(state, tmp_path / "b", overlap=True)
    stashpoint.load(make_training(64, seed=1), tmp_path / "b")
    assert not (tmp_path / "a" / "manifest.json").exists()


_FORK = """
import multiprocessing as mp, sys
sys.path.insert(0, sys.argv[2])
import torch, stashpoint
from stashpoint._save import overlap as _overlap
from test_overlap import Gate, forward_backward, make_training, snapshot, train_step
gate, copies = Gate(), _overlap.copy_deferred
def gated(triples):
    gate.entered.set()
    gate.release.wait(60)
    copies(triples)
_overlap.copy_deferred = gated
state = make_training(64)
train_step(state, 0)
ref = snapshot(state)
handle = stashpoint.async_save(state, sys.argv[1], overlap=True)
assert gate.entered.wait(30)
forward_backward(state, 1)  # the gradients the child's step uses
def child():
    state["adam"].step()
    state["sgd"].step()
proc = mp.get_context("fork").Process(target=child)
proc.start()
proc.join(30)
print("child", "hung" if proc.is_alive() else f"exited {proc.exitcode}")
if proc.is_alive():
    proc.kill()
gate.release.set()
handle.wait(timeout=60)
back = make_training(64, seed=1)
stashpoint.load(back, sys.argv[1])
print("parent saved the state at its call:", torch.equal(back["model"].fc1.weight, ref["model"]["fc1.weight"]))
"""


def test_a_child_forked_while_copies_are_pending_steps_its_optimizers(tmp_path):
    """A DataLoader worker (fork) made while an overlapped save's copies wait: the child's
    optimizers inherit the hooks, not the copy thread. Before: its step() waited for ever.
    In a process of one OpenMP thread: a forked child's torch ops may hang in torch's pool."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    tests = str(Path(__file__).parent)
    out = subprocess.run(
        [sys.executable, "-c", _FORK, str(tmp_path / "ck"), tests], env=env, capture_output=True, text=True, timeout=100
    )
    assert "child exited 0" in out.stdout, (out.stdout, out.stderr[-2000:])
    assert "parent saved the state at its call: True" in out.stdout, (out.stdout, out.stderr[-2000:])


def test_the_writer_process_runs_in_a_session_of_its_own(tmp_path):
    """A scheduler's SIGTERM to the process group, or a Ctrl-C, in the tenth of a second the
    writer process takes to start (before it ignores them) killed it and failed the save."""
    stashpoint.save({"w": torch.ones(4)}, tmp_path / "ck", writer="process")
    pid = writerproc.get().pid
    assert os.getsid(pid) == pid and os.getpgid(pid) != os.getpgid(0)


def test_the_call_lock_taken_over_after_a_ctrl_c_between_its_acquire_and_its_owner():
    lock = CallLock()
    lock._lock.acquire()  # a KeyboardInterrupt came right after this acquire returned
    with lock:  # before: a deadlock, then every save of every thread after it
        pass
    other = threading.Thread(target=lambda: lock.__enter__() or lock.__exit__(None, None, None))
    other.start()
    other.join(10)
    assert not other.is_alive(), "released for the other threads too"
    with lock, pytest.raises(stashpoint.CheckpointError, match="signal handler"), lock:
        pass


def test_the_engine_saves_again_after_all_of_this(tmp_path):
    assert get_engine().lock._lock.acquire(blocking=False)
    get_engine().lock._lock.release()
    stashpoint.save({"w": torch.ones(2)}, tmp_path / "ck")
