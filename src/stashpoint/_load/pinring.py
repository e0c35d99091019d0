"""Copies from host buffers to CUDA tensors through a small ring of pinned buffers.

A load reads each piece into ordinary (pageable) host memory; pinning a buffer per piece would
lock up to twice the state in host memory for the life of the process (torch's caching host
allocator rounds each to a power of two and keeps it), one serial ``cudaHostAlloc`` each. Instead
each piece is cut into segments of at most one slot, each segment is copied into a pinned slot
and from there to the device asynchronously, on a side stream; a slot is refilled once the
event recorded after its last copy has completed. The slots are allocated on the first load
into CUDA tensors and reused by every later one: a load pins ``SLOTS * SLOT_BYTES`` however
large the state.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, NamedTuple, Protocol

import torch

from stashpoint import _runtime
from stashpoint._state.dtypes import as_memoryview

log = logging.getLogger("stashpoint")

SLOTS = 4
SLOT_BYTES = 16 << 20

FLAT = "flat"  # bytes [start, stop) of a contiguous piece and of its (contiguous) target
ROWS = "rows"  # rows [start, stop) along dim 0: contiguous in the buffer, a view of the target
SYNC = "sync"  # the whole piece, copied synchronously from the host buffer (start 0, stop: bytes)


def writing(target: torch.Tensor) -> AbstractContextManager[Any]:
    """Where a load may copy into ``target``: without autograd (it may be a view of a
    parameter), and in inference mode for a tensor made in it (torch refuses the copy outside)."""
    return torch.inference_mode() if target.is_inference() else torch.no_grad()


class Segment(NamedTuple):
    kind: str
    start: int
    stop: int


def segments(shape: tuple[int, ...], itemsize: int, target_contiguous: bool, slot_bytes: int) -> list[Segment]:
    """How to copy a piece of ``shape`` through slots of ``slot_bytes``.

    A contiguous target is cut anywhere, as flat bytes; any other into blocks of whole rows
    along dim 0 (rows of the contiguous buffer are contiguous, rows of the target are views).
    A row larger than a slot, or a 0-dim piece with a non-contiguous target (none exists), is
    copied whole and synchronously: correct, only slower.
    """
    nbytes = math.prod(shape) * itemsize
    if nbytes == 0:
        return []
    if target_contiguous:
        return [Segment(FLAT, b, min(b + slot_bytes, nbytes)) for b in range(0, nbytes, slot_bytes)]
    per = slot_bytes // (nbytes // shape[0]) if shape else 0
    if per == 0:
        return [Segment(SYNC, 0, nbytes)]
    return [Segment(ROWS, r, min(r + per, shape[0])) for r in range(0, shape[0], per)]


class Waitable(Protocol):
    def synchronize(self) -> None: ...


class Backend:
    """How a ring's copies to a device are queued and waited for. This one is for CPU targets
    (and tests): a copy is synchronous, so there is no stream to enter and no event to wait for."""

    def on(self, device: torch.device) -> AbstractContextManager[Any]:
        """Enter the stream the copies to ``device`` are queued on."""
        return nullcontext()

    def event(self, device: torch.device) -> Waitable | None:
        """Something to wait on until the copies to ``device`` queued so far have completed."""
        return None

    def finish(self) -> None:
        """Wait for every copy queued (the load's targets are complete when this returns)."""


class CudaBackend(Backend):
    """Copies to a CUDA device run on its side stream, which first waits for the work already
    queued on the current stream (that may still use the targets)."""

    def __init__(self) -> None:
        self.streams: dict[torch.device, torch.cuda.Stream] = {}

    def on(self, device: torch.device) -> AbstractContextManager[Any]:
        if device.type != "cuda":
            return nullcontext()
        if device not in self.streams:
            from stashpoint._save.staging import side_stream

            stream = side_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            self.streams[device] = stream
        return _on_stream(device, self.streams[device])

    def event(self, device: torch.device) -> Waitable | None:
        if device.type != "cuda":
            return None
        event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]  # waits sleep, not spin
        event.record(self.streams[device])
        return event

    def finish(self) -> None:
        streams, self.streams = self.streams, {}
        for stream in streams.values():  # also the synchronous copies' device-side steps
            stream.synchronize()


class PinnedRing:
    """``slots`` host buffers of ``slot_bytes`` (pinned with ``pin``), allocated on first use and
    refilled in turn, each once its previous copy has completed."""

    def __init__(self, slots: int, slot_bytes: int, *, pin: bool, backend: Backend | None = None) -> None:
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"a ring needs at least one slot of at least one byte, got {slots} x {slot_bytes}")
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.pin = pin
        self.backend = backend if backend is not None else Backend()
        self.buffers: list[torch.Tensor] = []
        self.views: list[memoryview] = []  # the slots' bytes, for reader threads (no torch calls there)
        self.events: list[Waitable | None] = []
        self.held: set[int] = set()  # slots a reader is filling (see hold)
        self.turn = 0
        self.lock = threading.Lock()  # one load at a time uses the ring

    @contextmanager
    def session(self) -> Iterator[PinnedRing]:
        """Hold the ring for one load; on the way out (an error too) wait until every copy has
        landed, so the targets are complete and no slot is read from when the next load fills it."""
        with self.lock:
            try:
                yield self
            finally:
                self.drain()

    def drain(self) -> None:
        """Wait for every copy queued through the ring."""
        self.backend.finish()
        self.held.clear()
        for i, event in enumerate(self.events):
            if event is not None:
                event.synchronize()
                self.events[i] = None

    def hold(self) -> int | None:
        """A slot for a reader thread to fill (its last copy has completed), or None while all
        but one slot are held: one is always left for :meth:`copy`, which runs on the thread
        that lands the readers' slots (it must never wait for a slot only it can give back)."""
        if len(self.held) >= self.slots - 1:
            return None
        i = self._slot()
        self.held.add(i)
        return i

    def land(self, i: int, dst: torch.Tensor, n: int) -> None:
        """Queue the copy of held slot ``i``'s first ``n`` bytes into ``dst`` (contiguous bytes
        of a target) and give the slot back."""
        with torch.no_grad(), self.backend.on(dst.device):
            dst.copy_(self.buffers[i][:n], non_blocking=True)
            self.events[i] = self.backend.event(dst.device)
        self.held.discard(i)

    def unhold(self, i: int) -> None:
        """Give back held slot ``i`` without a copy (its read failed)."""
        self.held.discard(i)

    def copy(self, target: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``target.copy_(src)``, ``src`` a host tensor of ``target``'s shape, through the slots."""
        if target.shape != src.shape:  # segments are cut as bytes: no broadcasting
            raise ValueError(f"cannot copy a {tuple(src.shape)} tensor into a {tuple(target.shape)} one")
        flat = target.is_contiguous() and not target.is_conj() and not target.is_neg() and target.dtype == src.dtype
        plan = segments(tuple(src.shape), src.element_size(), flat, self.slot_bytes)
        if not plan:
            return
        src = src.contiguous()
        raw = src.reshape(-1).view(torch.uint8)
        row = src[0].numel() * src.element_size() if src.dim() else 0
        device = target.device
        with writing(target), self.backend.on(device):
            dst = target.reshape(-1).view(torch.uint8) if flat else target
            for kind, a, b in plan:
                if kind == SYNC:
                    target.copy_(src)
                    continue
                lo, hi = (a, b) if kind == FLAT else (a * row, b * row)
                i = self._slot()
                slot = self.buffers[i][: hi - lo]
                slot.copy_(raw[lo:hi])  # pageable -> pinned, on this thread
                if kind == FLAT:
                    dst[a:b].copy_(slot, non_blocking=True)
                else:
                    dst[a:b].copy_(slot.view(src.dtype).view((b - a, *src.shape[1:])), non_blocking=True)
                self.events[i] = self.backend.event(device)

    def _slot(self) -> int:
        """The next slot in turn that no reader holds, once its last copy has completed
        (allocated on first use)."""
        i = next(
            (self.turn + k) % self.slots for k in range(self.slots) if (self.turn + k) % self.slots not in self.held
        )
        while len(self.buffers) <= i:
            self.buffers.append(self._allocate())
            self.views.append(as_memoryview(self.buffers[-1]))
            self.events.append(None)
        if (event := self.events[i]) is not None:
            event.synchronize()
            self.events[i] = None
        self.turn = (i + 1) % self.slots
        return i

    def _allocate(self) -> torch.Tensor:
        if self.pin:
            try:
                return torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as e:  # copies from pageable memory are still correct, only slower
                log.warning("stashpoint: could not pin a %d-byte load buffer: %s", self.slot_bytes, e)
        return torch.empty(self.slot_bytes, dtype=torch.uint8)


def ring() -> PinnedRing:
    """The process's ring for loads into CUDA tensors, made on first use and kept."""
    return _runtime.slot("load.pinned_ring", lambda: PinnedRing(SLOTS, SLOT_BYTES, pin=True, backend=CudaBackend()))


@contextmanager
def _on_stream(device: torch.device, stream: torch.cuda.Stream) -> Iterator[None]:
    """``stream`` made current on ``device``, that device made current first: leaving a stream
    context on a thread whose current device is another sets that device (a context on GPU 0
    for a rank whose tensors are on another GPU)."""
    with torch.cuda.device(device), torch.cuda.stream(stream):
        yield
