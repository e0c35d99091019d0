"""Loads and saves' calls run without automatic cyclic garbage collection.

In a process whose heap holds many objects, the small objects a load makes (parsed indexes,
plans) set off full collections that walked 300,000 objects for 0.17 s inside a 0.16 s load
(benchmarks/RESULTS.md). The collector is paused for the call and resumed after, whatever
happens, from any thread, nested or not.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import stashpoint
from stashpoint._runtime import gc_paused


class Probe:
    """A stateful object that records whether the collector ran while it was saved and loaded."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bool]] = []

    def state_dict(self) -> dict[str, Any]:
        self.seen.append(("save", gc.isenabled()))
        return {"x": 1}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.seen.append(("load", gc.isenabled()))


@pytest.fixture(autouse=True)
def collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_a_save_call_and_a_load_see_the_collector_paused_and_leave_it_on(tmp_path: Path) -> None:
    probe = Probe()
    state = {"w": torch.arange(10.0), "probe": probe}
    stashpoint.save(state, tmp_path / "c")
    stashpoint.load(state, tmp_path / "c")
    assert probe.seen[0] == ("save", False) and probe.seen[-1] == ("load", False)
    assert not any(on for _, on in probe.seen)  # the load's own state_dict() call too
    assert gc.isenabled()


def test_a_manager_restore_runs_paused(tmp_path: Path) -> None:
    probe = Probe()
    state = {"w": torch.arange(10.0), "probe": probe}
    with stashpoint.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, state).wait()
        probe.seen.clear()
        assert mgr.restore(state) == 1
    assert probe.seen[-1] == ("load", False) and not any(on for _, on in probe.seen)
    assert gc.isenabled()


def test_a_failed_load_leaves_the_collector_on_and_a_disabled_one_off(tmp_path: Path) -> None:
    state = {"w": torch.zeros(3)}
    with pytest.raises(stashpoint.CheckpointError):
        stashpoint.load(state, tmp_path / "missing")
    assert gc.isenabled()
    stashpoint.save(state, tmp_path / "c")
    gc.disable()  # the program's own choice stays
    stashpoint.load(state, tmp_path / "c")
    assert not gc.isenabled()


def test_pauses_nest_across_threads_and_the_last_one_out_resumes() -> None:
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with gc_paused():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    with gc_paused():
        t.start()
        assert inside.wait(10)
        with gc_paused():
            assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread's pause still holds
    leave.set()
    t.join(10)
    assert gc.isenabled()
