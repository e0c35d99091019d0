"""The order of the CUDA staging path's stream calls, recorded on a CPU.

The GPU check (benchmarks/gpu_check.py) proves the ordering on a GPU with race probes that fail
when a wait is removed; these tests keep the logic from regressing between GPU runs. The CUDA
stream and event calls are replaced by recorders, and CPU tensors stand in for CUDA ones (the
copies themselves run synchronously).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from stashpoint._save import cudacopy, overlap


class _Recorder:
    def __init__(self) -> None:
        self.log: list[str] = []
        self.events = 0


class _Stream:
    def __init__(self, rec: _Recorder, name: str) -> None:
        self.rec, self.name = rec, name

    def wait_stream(self, other: _Stream) -> None:
        self.rec.log.append(f"{self.name} waits for {other.name}")

    def wait_event(self, event: _Event) -> None:
        self.rec.log.append(f"{self.name} waits for {event.name}")

    def synchronize(self) -> None:
        self.rec.log.append(f"host waits for {self.name}")


class _Event:
    rec: _Recorder

    def __init__(self, blocking: bool = False, **_: object) -> None:
        self.rec.events += 1
        self.name = f"event{self.rec.events}" + (" (blocking)" if blocking else "")

    def record(self, stream: _Stream) -> None:
        self.rec.log.append(f"{self.name} after {stream.name}")

    def synchronize(self) -> None:
        self.rec.log.append(f"host waits for {self.name}")


@pytest.fixture
def rec(monkeypatch) -> _Recorder:
    rec = _Recorder()
    side, current = _Stream(rec, "side"), _Stream(rec, "current")

    @contextlib.contextmanager
    def on(stream: _Stream) -> Iterator[None]:
        rec.log.append(f"on {stream.name}")
        yield
        rec.log.append(f"off {stream.name}")

    @contextlib.contextmanager
    def device(d: torch.device) -> Iterator[None]:
        rec.log.append(f"device {d}")
        yield
        rec.log.append(f"device back from {d}")

    real_gather = cudacopy._gather

    def gather(run: list) -> None:
        rec.log.append(f"gather {len(run)}")
        real_gather(run)

    monkeypatch.setattr(cudacopy, "side_stream", lambda device: side)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "Event", type("Event", (_Event,), {"rec": rec}))
    monkeypatch.setattr(cudacopy, "_gather", gather)
    return rec


def _pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two runs of small neighbours in one staging buffer, a large tensor between them."""
    buf = torch.zeros(4 * 4096, dtype=torch.uint8)

    def at(offset: int) -> torch.Tensor:
        return buf[offset : offset + 64].view(torch.float32)

    big = (torch.ones(300_000), torch.zeros(300_000))
    return [
        (torch.ones(16), at(0)),
        (torch.ones(16), at(64)),
        big,
        (torch.ones(16), at(8192)),
        (torch.ones(16), at(8256)),
    ]


def test_copies_run_on_the_side_stream_after_the_training_work_and_before_a_blocking_event(rec):
    pairs = _pairs()
    events = cudacopy.launch_cuda(pairs)
    assert rec.log == [
        "side waits for current",
        "device cpu",  # the stream's device current first: leaving the stream would set the thread's
        "on side",
        "gather 2",
        "gather 2",
        "event1 (blocking) after side",
        "off side",
        "device back from cpu",
    ]
    assert [e.name for _, e in events] == ["event1 (blocking)"]
    assert all(torch.equal(s, d) for s, d in pairs)


def test_copies_launched_later_wait_for_the_event_recorded_at_the_call(rec):
    at_call = torch.cuda.Event()
    cudacopy.launch_cuda(_pairs(), after={torch.device("cpu"): at_call})
    assert rec.log[:3] == ["side waits for event1", "device cpu", "on side"]


def test_a_launch_that_fails_half_way_waits_for_the_copies_it_queued(rec, monkeypatch):
    calls = []

    def gather_then_oom(run: list) -> None:
        calls.append(run)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory allocating a gather's scratch")
        rec.log.append("gather 2")

    monkeypatch.setattr(cudacopy, "_gather", gather_then_oom)
    with pytest.raises(torch.OutOfMemoryError):
        cudacopy.launch_cuda(_pairs())
    assert rec.log[-1] == "host waits for side", "the buffers go back to the pool only once no copy runs into them"


def test_a_held_step_orders_the_training_stream_after_the_copies(rec):
    pending = overlap.PendingCopies("somewhere", [], [])
    pending._cpu_done.set()
    pending._events = cudacopy.launch_cuda(_pairs())
    rec.log.clear()
    pending.hold_step()
    assert rec.log == ["current waits for event1 (blocking)"]
