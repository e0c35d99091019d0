"""How a transfer's bytes move: read from a step's files (or received from a peer) in 64 MiB
pieces, two buffers deep, and landed in a node's step directory through the page cache."""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path
from typing import Any

from stashpoint._core.naming import split_group
from stashpoint._dist.group import DistContext
from stashpoint._dist.nodes import recv_tensor, send_tensor
from stashpoint._storage import LocalStorage, Storage
from stashpoint._storage.localwrite import LocalWriter
from stashpoint.errors import CheckpointError

CHUNK = 64 << 20


def as_memoryview(t: Any) -> memoryview:
    """The bytes of a contiguous CPU uint8 tensor, without a copy."""
    return t.numpy().data.cast("B")  # type: ignore[no-any-return]


class Landing(LocalStorage):
    """A step directory that received files are written into through the page cache (the load
    that follows reads them there), without an fsync each unless ``durable`` (a replica is a
    recovery copy; a restore's fetch can be fetched again, and the load verifies every byte)."""

    def __init__(self, root: Path, *, durable: bool) -> None:
        super().__init__(root, direct_io=False, cache_newest=False)
        self.durable = durable

    def open_writer(self, name: str, size: int) -> Any:
        parts = split_group(name)
        if parts is None or parts[0]:
            return super().open_writer(name, size)  # group directories: the usual path
        return LocalWriter(self.root / parts[1], size, durable=self.durable)


class Stream:
    """One transfer's bytes in 64 MiB pieces, two buffers deep: the next piece is read while
    one is sent, and the last one written while the next is received. A side that fails
    part-way (a file that cannot be read, a disk that is full) still sends or receives every
    piece announced, zeros or discarded, so that its peer and every later transfer stay in
    step; it raises at the end (:meth:`done`)."""

    def __init__(self, ctx: DistContext | None, peer: int, source: Storage | None = None, tag: int = 0) -> None:
        import torch

        # source: receive from that storage (a step's remote copy) instead of from rank ``peer``
        self.ctx, self.peer, self.source, self.tag = ctx, peer, source, tag
        self.bufs = [torch.empty(CHUNK, dtype=torch.uint8) for _ in range(2)]
        self.mvs = [as_memoryview(b) for b in self.bufs]
        self.error: BaseException | None = None
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="stashpoint-transfer")
        self._turn = 0

    def _read(self, step: Storage, name: str, off: int, mv: memoryview) -> None:
        if self.error is None:
            try:
                step.readv(name, off, [mv])
                return
            except (OSError, EOFError, CheckpointError) as e:
                self.error = CheckpointError(f"reading {step.location}/{name}: {e}")
        mv[:] = bytes(len(mv))

    def send(self, step: Storage, name: str, start: int, end: int) -> None:
        pieces = [(off, min(CHUNK, end - off)) for off in range(start, end, CHUNK)]
        ahead: cf.Future[None] | None = None
        for i, (off, n) in enumerate(pieces):
            k = (self._turn + i) % 2
            if ahead is None:
                self._read(step, name, off, self.mvs[k][:n])
            else:
                ahead.result()
            if i + 1 < len(pieces):
                nk, (noff, nn) = (k + 1) % 2, pieces[i + 1]
                ahead = self._pool.submit(self._read, step, name, noff, self.mvs[nk][:nn])
            assert self.ctx is not None
            send_tensor(self.ctx, self.peer, self.bufs[k][:n], self.tag)
        self._turn = (self._turn + len(pieces)) % 2

    def _sink(self, sink: Any, off: int, mv: memoryview) -> None:
        if self.error is None:
            try:
                sink(off, mv)
            except (OSError, CheckpointError) as e:
                self.error = e

    def receive(self, size: int, sink: Any, name: str, start: int = 0) -> None:
        """``size`` bytes of ``name`` from ``start``, each piece given in order to
        ``sink(offset, memoryview)`` (on another thread, while the next piece arrives) until it
        fails."""
        behind: cf.Future[None] | None = None
        for i, off in enumerate(range(0, size, CHUNK)):
            n, k = min(CHUNK, size - off), i % 2
            if self.source is not None:
                self._read(self.source, name, start + off, self.mvs[k][:n])
            else:
                assert self.ctx is not None
                recv_tensor(self.ctx, self.peer, self.bufs[k][:n], self.tag)
            if behind is not None:
                behind.result()
            behind = self._pool.submit(self._sink, sink, off, self.mvs[k][:n])
        if behind is not None:
            behind.result()

    def done(self) -> None:
        self._pool.shutdown(wait=True)
        if self.error is not None:
            raise self.error
