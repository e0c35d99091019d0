"""How a transfer's bytes move: read from a step's files (or received from a peer) in messages
of up to 16 MiB (64 MiB pieces from a remote tier), two page-aligned buffers deep, and landed
in a node's step directory with direct I/O where the file system allows it.

The buffers are kept for the next transfer of the process (a replica is sent and received at
every save): fresh ones had their pages faulted in at every transfer."""

from __future__ import annotations

import concurrent.futures as cf
import json
import mmap
import threading
from collections.abc import Sequence
from typing import Any

from stashpoint import _runtime
from stashpoint._dist.group import DistContext
from stashpoint._dist.nodes import recv_blob, recv_tensor, send_blob, send_tensor
from stashpoint._state.dtypes import as_memoryview
from stashpoint._storage import Storage
from stashpoint._storage.directio import BouncePool
from stashpoint._storage.oserror import says_damage
from stashpoint.errors import CheckpointError, CorruptCheckpointError

CHUNK = 16 << 20  # gloo moves these as fast as larger ones, with less memory to fault in
_KEEP = 4  # idle buffers kept: a replica's send and receive run at once, two buffers each
# reads from a remote tier: each readv fetches its ranged GETs in parallel (32 MiB parts by
# default), so larger reads keep several requests in flight
_REMOTE_CHUNK = 64 << 20
_STATUS_CHARS = 2000  # of a sender's error told to its receiver


def _pool() -> BouncePool:
    """The process's transfer buffers: page-aligned (direct reads and writes use them as they
    are), on huge pages where the kernel allows it, kept for the next transfer."""
    return _runtime.slot("dist.stream-buffers", lambda: BouncePool(CHUNK, keep=_KEEP))


def warm(count: int = 2) -> threading.Thread:
    """Make ``count`` of the process's transfer buffers on a thread, so that its first
    transfer finds them: a restore's fetch comes right after a fresh process starts, and
    populating huge pages there can wait for the kernel to compact memory (35 ms per 16 MiB
    buffer seen in a restarted node's process, against 1.3 ms in a quiet one). A transfer
    that starts first waits for them (``BouncePool.prepare``)."""
    return _pool().prepare(count)


def pieces(ranges: Sequence[tuple[int, int]], chunk: int = CHUNK) -> list[list[tuple[int, int]]]:
    """Byte ranges of one file packed, in order, into messages of at most ``chunk`` bytes (a
    range larger than that is split across messages): the many small ranges of a sparse copy
    (the step counters of every parameter) go as one message, not one each. Pure."""
    out: list[list[tuple[int, int]]] = []
    cur: list[tuple[int, int]] = []
    room = chunk
    for a, b in ranges:
        at = a
        while at < b:
            n = min(b - at, room)
            cur.append((at, at + n))
            at, room = at + n, room - n
            if room == 0:
                out.append(cur)
                cur, room = [], chunk
    if cur:
        out.append(cur)
    return out


def _size(piece: list[tuple[int, int]]) -> int:
    return sum(b - a for a, b in piece)


class Stream:
    """One transfer's bytes, a file's byte ranges packed into messages of up to 16 MiB
    (:func:`pieces`; from a remote tier, ``source``, pieces of 64 MiB), two buffers deep: the
    next message is read while one is sent, and the last one written while the next is
    received. A side that fails part-way (a file that cannot be read, a disk that is full)
    still sends or receives every message announced, zeros or discarded, so that its peer and
    every later transfer stay in step; it raises at the end (:meth:`done`)."""

    def __init__(self, ctx: DistContext | None, peer: int, source: Storage | None = None, tag: int = 0) -> None:
        import torch

        # source: receive from that storage (a step's remote copy) instead of from rank ``peer``
        self.ctx, self.peer, self.source, self.tag = ctx, peer, source, tag
        self.chunk = CHUNK if source is None else _REMOTE_CHUNK
        # a remote tier's are made for each fetch and filled by S3, not by direct I/O: plain
        # mappings, faulted in as they fill
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        self._maps = [_pool().take() if source is None else mmap.mmap(-1, self.chunk, flags=flags) for _ in range(2)]
        self.bufs = [torch.frombuffer(m, dtype=torch.uint8) for m in self._maps]
        self.mvs = [as_memoryview(b) for b in self.bufs]
        self.error: BaseException | None = None
        self.failed_at = ""  # the file whose bytes could not be landed, if that is the error
        self._executor = cf.ThreadPoolExecutor(1, thread_name_prefix="stashpoint-transfer")
        self._turn = 0

    def _read(self, step: Storage, name: str, piece: list[tuple[int, int]], mv: memoryview) -> None:
        if self.error is None:
            try:
                pos = 0
                for a, b in piece:
                    step.readv(name, a, [mv[pos : pos + b - a]])
                    pos += b - a
                return
            except (OSError, EOFError, CheckpointError) as e:
                # a file gone, cut short or unreadable for good: the copy is damaged
                self.error = (CorruptCheckpointError if says_damage(e) else CheckpointError)(
                    f"reading {step.location}/{name}: {e}"
                )
        mv[:] = bytes(len(mv))

    def send(self, step: Storage, name: str, ranges: Sequence[tuple[int, int]]) -> None:
        """Send the byte ranges ``ranges`` of ``name`` (in ``step``), in order."""
        assert self.source is None, "a remote tier's stream only receives"
        ps = pieces(ranges, self.chunk)  # as the peer's receive splits them
        ahead: cf.Future[None] | None = None
        for i, piece in enumerate(ps):
            k, n = (self._turn + i) % 2, _size(piece)
            if ahead is None:
                self._read(step, name, piece, self.mvs[k][:n])
            else:
                ahead.result()
            if i + 1 < len(ps):
                nk, nxt = (k + 1) % 2, ps[i + 1]
                ahead = self._executor.submit(self._read, step, name, nxt, self.mvs[nk][: _size(nxt)])
            assert self.ctx is not None
            send_tensor(self.ctx, self.peer, self.bufs[k][:n], self.tag)
        self._turn = (self._turn + len(ps)) % 2

    def _sink(self, sink: Any, name: str, piece: list[tuple[int, int]], mv: memoryview) -> None:
        pos = 0
        for a, b in piece:
            if self.error is not None:
                return
            try:
                sink(a, mv[pos : pos + b - a])
            except (OSError, CheckpointError) as e:
                self.error, self.failed_at = e, name
            pos += b - a

    def receive(self, name: str, ranges: Sequence[tuple[int, int]], sink: Any) -> None:
        """The byte ranges ``ranges`` of ``name`` (as :meth:`send` sent them), each given in
        order to ``sink(file_offset, memoryview)`` (on another thread, while the next message
        arrives) until it fails."""
        behind: cf.Future[None] | None = None
        for i, piece in enumerate(pieces(ranges, self.chunk)):
            n, k = _size(piece), i % 2
            if self.source is not None:
                self._read(self.source, name, piece, self.mvs[k][:n])
            else:
                assert self.ctx is not None
                recv_tensor(self.ctx, self.peer, self.bufs[k][:n], self.tag)
            if behind is not None:
                behind.result()
            behind = self._executor.submit(self._sink, sink, name, piece, self.mvs[k][:n])
        if behind is not None:
            behind.result()

    def done_sending(self) -> None:
        """A sender's end: tell the receiver whether every byte it sent was read (a read that
        failed went as zeros: the receiver must not take its copy for whole), then raise this
        side's error, if any."""
        self._executor.shutdown(wait=True)
        status = b""
        if self.error is not None:
            damage = isinstance(self.error, CorruptCheckpointError)
            status = json.dumps({"error": str(self.error)[:_STATUS_CHARS], "damage": damage}).encode()
        assert self.ctx is not None
        send_blob(self.ctx, self.peer, status, self.tag)
        self.done()

    def done_receiving(self) -> None:
        """A receiver's end: this side's error, if any; else the sender's (from a peer: some
        byte it sent could not be read, so what landed is not a whole copy)."""
        sent: dict[str, Any] = {}
        if self.source is None:
            assert self.ctx is not None
            raw = recv_blob(self.ctx, self.peer, 2 * _STATUS_CHARS, self.tag)
            try:
                got = json.loads(raw) if raw else {}
            except (ValueError, RecursionError):
                got = None
            sent = got if isinstance(got, dict) else {}
            if not isinstance(got, dict):
                sent = {"error": f"an unreadable status ({len(raw)} bytes)", "damage": False}
        if isinstance(self.error, OSError) and not isinstance(self.error, CheckpointError):
            # this node's own disk or memory area failed: no sign of damage to the copy sent
            at = f" (writing {self.failed_at})" if self.failed_at else ""
            self.error = CheckpointError(f"landing the transfer on this node failed{at}: {self.error}")
        self.done()
        if sent:
            error = CorruptCheckpointError if sent.get("damage") is True else CheckpointError
            raise error(f"rank {self.peer} could not read all it sent: {str(sent.get('error'))[:_STATUS_CHARS]}")

    def done(self) -> None:
        self._executor.shutdown(wait=True)
        if self._maps:  # no thread of this stream touches them any more (a stream that raised
            # before this point keeps its buffers: they are never handed to another)
            del self.bufs, self.mvs
            for m in self._maps if self.source is None else ():
                _pool().give(m)
            self._maps = []
        if self.error is not None:
            raise self.error
