"""Whole pieces of a load read straight into the pinned ring's slots, then sent to the device.

A piece bound for a contiguous CUDA tensor needs no host buffer of its own: reader threads fill
the ring's pinned slots with it one segment at a time (whole checksum blocks, verified as they
arrive), and the caller's thread sends each slot on to the device, refilling it once that copy
is done. Host memory stays the ring's, however large the state, and the pinned slots are reused
from one load to the next (no fresh pages to fault in).
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any

import torch

from stashpoint._core.format import CHECKSUM_BLOCK_BYTES, block_checksums
from stashpoint._load.pinring import PinnedRing
from stashpoint._storage import Storage
from stashpoint.errors import CorruptCheckpointError


class SlotReads:
    """Whole pieces bound for contiguous CUDA tensors, read straight into the pinned ring's
    slots: segments of whole checksum blocks, each read and verified by a reader thread, then
    copied to the device from the caller's thread (``PinnedRing.land``), its slot refilled once
    that copy is done. Host memory: the ring's slots, however large the pieces."""

    def __init__(self, pieces: list[Any], ring: PinnedRing, storage: Storage, shared: Storage, verify: bool) -> None:
        step = ring.slot_bytes // CHECKSUM_BLOCK_BYTES * CHECKSUM_BLOCK_BYTES
        if step <= 0:
            raise ValueError(f"a slot of {ring.slot_bytes} bytes holds no whole checksum block")
        self.todo = [(p, off, min(step, _nbytes(p) - off)) for p in pieces for off in range(0, _nbytes(p), step)]
        self.todo.reverse()
        self.ring, self.storage, self.shared, self.verify = ring, storage, shared, verify
        self.inflight: dict[cf.Future[None], tuple[int, Any, int, int]] = {}

    device_type = "cuda"  # the targets it serves (the tests use the CPU)

    @classmethod
    def pieces(cls, pieces: list[Any]) -> list[Any]:
        """The pieces it can read: whole, bound for a contiguous tensor of ``device_type``."""
        t = [p for p in pieces if p.whole and p.target.device.type == cls.device_type and p.target.numel()]
        return [p for p in t if p.target.is_contiguous() and not (p.target.is_complex() or p.target.is_neg())]

    def feed(self, pool: cf.Executor) -> set[cf.Future[None]]:
        """Start a read for every slot that can be held now."""
        started = set()
        while self.todo and (i := self.ring.hold()) is not None:
            p, off, n = self.todo.pop()
            source = self.shared if p.shared else self.storage
            f = pool.submit(_read_segment, source, p, off, self.ring.views[i][:n], self.verify)
            self.inflight[f] = (i, p, off, n)
            started.add(f)
        return started

    def landed(self, f: cf.Future[None], errors: list[str]) -> cf.Future[None] | None:
        """A segment's read ended: send it on to the device (unless this load failed); the
        future back if it failed."""
        i, p, off, n = self.inflight.pop(f)
        if f.exception() is not None or errors:
            self.ring.unhold(i)
            return f if f.exception() is not None else None
        self.ring.land(i, p.target.reshape(-1).view(torch.uint8)[off : off + n], n)
        return None


def _nbytes(p: Any) -> int:
    return int(p.target.numel() * p.itemsize)


def _read_segment(storage: Storage, p: Any, off: int, out: memoryview, verify: bool) -> None:
    """Read bytes ``[off, off + len(out))`` of ``p``'s chunk into ``out`` and check their
    blocks (``off`` is a multiple of the checksum block). Runs on a reader thread: no torch."""
    try:
        storage.readv(p.chunk.file, p.chunk.start + off, [out])
    except EOFError as e:
        raise CorruptCheckpointError(
            f"shard {storage.location}/{p.chunk.file} is truncated inside {p.key!r}: {e}"
        ) from None
    if verify:
        first = off // CHECKSUM_BLOCK_BYTES
        sums = block_checksums(out)
        if sums != p.chunk.checksums[first : first + len(sums)]:
            raise p.bad(storage)
