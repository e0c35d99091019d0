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


@dataclass
class StagingBuffers:
    """One host buffer per shard file of a plan, and typed views of each tensor's bytes."""

    plan: SavePlan
    specs: tuple[TensorSpec, ...]
    pinned: bool
    buffers: list[torch.Tensor]
    views: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    @classmethod
    def allocate(cls, plan: SavePlan, specs: tuple[TensorSpec, ...], pinned: bool) -> StagingBuffers:
        buffers = [_host_buffer(f.data_size, pinned) for f in plan.files]
        by_key = {s.key: s for s in specs}
        views: dict[str, torch.Tensor] = {}
        for f, buf in zip(plan.files, buffers):
            for p in f.placements:
                spec = by_key[p.key]
                dtype = dtype_from_name(spec.dtype, p.key)
                views[p.key] = buf[p.begin : p.end].view(dtype).reshape(spec.shape)
        return cls(plan, specs, pinned, buffers, views)


class StagingPool:
    """Keeps free staging buffers for reuse; at most ``max_free`` sets are kept idle."""

    def __init__(self, max_free: int = 1) -> None:
        self.max_free = max_free
        self._free: list[StagingBuffers] = []
        self._lock = threading.Lock()

    def acquire(self, plan: SavePlan, specs: tuple[TensorSpec, ...], pinned: bool) -> StagingBuffers:
        """Buffers laid out for ``plan`` and ``specs``: reused when an idle set matches."""
        with self._lock:
            for i, b in enumerate(self._free):
                if b.plan == plan and b.specs == specs and b.pinned == pinned:
                    return self._free.pop(i)
            # A different structure: drop idle buffers first so memory never grows.
            self._free.clear()
        return StagingBuffers.allocate(plan, specs, pinned)

    def release(self, buffers: StagingBuffers) -> None:
        with self._lock:
            self._free.append(buffers)
            del self._free[: max(0, len(self._free) - self.max_free)]

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


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
