"""Host staging buffers: allocated once per state structure, reused by later saves.

On the CPU a buffer is page-aligned anonymous memory (so writes can use direct I/O from it). The
first save of a structure pays for touching fresh memory; later saves copy into touched pages at
memory bandwidth. When any tensor lives on a CUDA device the buffers are pinned, and copies run
on a side stream.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ._format import dtype_from_name
from ._plan import SavePlan, TensorSpec


def as_memoryview(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy).

    The caller keeps ``t`` alive while the view is in use.
    """
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    if pinned:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    # Page-aligned anonymous memory, so shard writes can use direct I/O straight from it.
    # (Transparent huge pages were measured slower to first-touch here: the kernel compacts.)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(m, dtype=torch.uint8)


_PAGE = 4096


def _layout_bytes(plan: SavePlan) -> int:
    """Bytes of one buffer holding every file's data, each file starting page-aligned."""
    return sum(-(-f.data_size // _PAGE) * _PAGE for f in plan.files)


@dataclass
class StagingBuffers:
    """One host buffer holding the data of every shard file of a plan (each file's region
    page-aligned), and typed views of each tensor's bytes in it."""

    plan: SavePlan
    specs: tuple[TensorSpec, ...]
    pinned: bool
    buffer: torch.Tensor
    views: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @classmethod
    def allocate(cls, plan: SavePlan, specs: tuple[TensorSpec, ...], pinned: bool) -> StagingBuffers:
        return cls.layout(_host_buffer(_layout_bytes(plan), pinned), plan, specs, pinned)

    @classmethod
    def layout(
        cls, buffer: torch.Tensor, plan: SavePlan, specs: tuple[TensorSpec, ...], pinned: bool
    ) -> StagingBuffers:
        """Lay ``plan`` out in ``buffer`` (at least :func:`_layout_bytes` long)."""
        by_key = {s.key: s for s in specs}
        views: dict[str, torch.Tensor] = {}
        base = 0
        for f in plan.files:
            for p in f.placements:
                spec = by_key[p.key]
                dtype = dtype_from_name(spec.dtype, p.key)
                views[p.key] = buffer[base + p.begin : base + p.end].view(dtype).reshape(spec.shape)
            base += -(-f.data_size // _PAGE) * _PAGE
        return cls(plan, specs, pinned, buffer, views)


class StagingPool:
    """Keeps idle staging memory for reuse (at most ``max_free`` buffers).

    A buffer laid out for the same plan is reused as is. Otherwise an idle buffer that is large
    enough (and not much larger) is laid out anew: its pages are already touched, which is what
    makes a copy fast. Only when none fits is fresh memory allocated, and idle buffers are
    dropped first so memory never grows.
    """

    def __init__(self, max_free: int = 1) -> None:
        self.max_free = max_free
        self._free: list[StagingBuffers] = []
        self._lock = threading.Lock()

    def acquire(self, plan: SavePlan, specs: tuple[TensorSpec, ...], pinned: bool) -> StagingBuffers:
        """Buffers laid out for ``plan`` and ``specs``."""
        need = _layout_bytes(plan)
        with self._lock:
            for i, b in enumerate(self._free):
                if b.plan == plan and b.specs == specs and b.pinned == pinned:
                    return self._free.pop(i)
            for i, b in enumerate(self._free):
                if b.pinned == pinned and need <= b.nbytes <= need + need // 4 + _PAGE:
                    return StagingBuffers.layout(self._free.pop(i).buffer, plan, specs, pinned)
            self._free.clear()
        return StagingBuffers.allocate(plan, specs, pinned)

    def release(self, buffers: StagingBuffers) -> None:
        with self._lock:
            self._free.append(buffers)
            del self._free[: max(0, len(self._free) - self.max_free)]


_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    return _streams[device]


def stage(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each ``(source, staging view)`` pair; returns once every copy has completed.

    CUDA sources are copied on a per-device side stream that first waits for the work already
    queued on the current stream, so the copies see the latest values.
    """
    cuda: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for src, dst in pairs:
        if src.device.type == "cuda":
            cuda.setdefault(src.device, []).append((src, dst))
        else:
            dst.copy_(src)
    streams = []
    for device, items in cuda.items():
        stream = _side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for src, dst in items:
                dst.copy_(src, non_blocking=True)
        streams.append(stream)
    for stream in streams:
        stream.synchronize()


def launch_cuda(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.device, torch.cuda.Event]]:
    """Queue the copies of CUDA sources without waiting for them; return one event per device.

    Each device's copies run on its side stream after the work already queued on the current
    stream (so they see the values at the time of the call); the event is recorded after them.
    Every source is marked as used by the side stream, so that its memory is not handed to
    another tensor before the copy has read it, even if the caller drops it.
    """
    by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for src, dst in pairs:
        by_device.setdefault(src.device, []).append((src, dst))
    events = []
    for device, items in by_device.items():
        stream = _side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for src, dst in items:
                dst.copy_(src, non_blocking=True)
                src.record_stream(stream)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        events.append((device, event))
    return events
