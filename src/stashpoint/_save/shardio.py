"""Writing a rank's planned shard files out of staging memory: the heavy part of a persist.

This is the part a save's writer runs — the writer thread, or the writer process
(``_writerchild``) on the same pages mapped from shared memory. It imports no torch, so the
writer process starts in milliseconds and holds a few MiB. What the files hold is decided
beforehand by ``_persist.write_shards`` (headers, which bytes of staging memory go where);
here those bytes are written in large aligned blocks (direct I/O where the storage allows) and
checksummed in the same pass.

The records travel to the writer process as plain JSON (:meth:`ShardWrite.to_wire`); tensor
bytes never do.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import xxhash

from stashpoint import _runtime
from stashpoint._storage import FileWriter, Storage

WRITE_BLOCK = 64 * 1024 * 1024  # bytes per write() call of a coalesced run
PROGRESS_BLOCK = 16 * 1024 * 1024  # in the writer process, which reports its progress
CHECKSUM = "xxh3_64"  # the algorithm of ``_format.checksum``; a test keeps the two equal


@dataclass(frozen=True)
class Piece:
    """One tensor's bytes: ``nbytes`` at ``offset`` in the staging memory."""

    key: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ShardWrite:
    """One shard file: ``header``, then each piece's bytes, back to back, in order."""

    name: str
    header: bytes
    pieces: tuple[Piece, ...]

    @property
    def size(self) -> int:
        return len(self.header) + sum(p.nbytes for p in self.pieces)

    def to_wire(self) -> dict[str, Any]:
        """Plain JSON-able data (the header as base64)."""
        return {
            "name": self.name,
            "header": base64.b64encode(self.header).decode("ascii"),
            "pieces": [[p.key, p.offset, p.nbytes] for p in self.pieces],
        }

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> ShardWrite:
        pieces = tuple(Piece(str(k), int(o), int(n)) for k, o, n in doc["pieces"])
        return cls(str(doc["name"]), base64.b64decode(doc["header"]), pieces)


def block_sums(data: memoryview, block: int) -> tuple[str, ...]:
    """The checksum (xxh3-64, hex) of each ``block`` bytes of ``data``; one for empty data.

    The same values as ``_format.block_checksums`` with ``block = CHECKSUM_BLOCK_BYTES``.
    """
    if not len(data):
        return (xxhash.xxh3_64_hexdigest(data),)
    return tuple(xxhash.xxh3_64_hexdigest(data[b : b + block]) for b in range(0, len(data), block))


Progress = Callable[[int], None]
"""Called with the bytes just written (0 when a file became durable), from any write thread."""


def _no_progress(n: int) -> None:
    pass


def _write_run(writer: FileWriter, run: memoryview, progress: Progress) -> None:
    # Smaller writes where someone listens for progress: one 64 MiB write on a disk slower than
    # the writer process's stall limit allows would look like a stall.
    step = WRITE_BLOCK if progress is _no_progress else PROGRESS_BLOCK
    for b in range(0, len(run), step):
        writer.write(run[b : b + step])
        progress(min(step, len(run) - b))


def _write_file(
    storage: Storage, w: ShardWrite, memory: memoryview, block: int, progress: Progress
) -> dict[str, tuple[str, ...]]:
    """Write one shard durably; its pieces' block checksums, by key. Aborted (removed) on failure."""
    sums: dict[str, tuple[str, ...]] = {}
    writer = storage.open_writer(w.name, w.size)
    try:
        writer.write(w.header)
        start = end = -1
        for p in w.pieces:
            sums[p.key] = block_sums(memory[p.offset : p.offset + p.nbytes], block)
            if not p.nbytes:
                continue
            if p.offset != end:  # not adjacent to the run so far: write that run, start another
                if end > start:
                    _write_run(writer, memory[start:end], progress)
                start = p.offset
            end = p.offset + p.nbytes
        if end > start:
            _write_run(writer, memory[start:end], progress)
        writer.close()
        progress(0)
    except BaseException:
        writer.abort()
        raise
    return sums


T = TypeVar("T")


def write_files(
    storage: Storage,
    writes: Sequence[ShardWrite],
    memory: memoryview,
    *,
    block: int,
    streams: int | None = None,
    progress: Progress = _no_progress,
) -> dict[str, tuple[str, ...]]:
    """Write each shard durably (``close()`` returns once it is) from ``memory``; return the
    block checksums of every piece, by key.

    Pieces that lie back to back in ``memory`` are written as one run. Up to ``streams`` files
    (default: ``storage.write_streams``) are written at once, each by a thread of its own: a disk
    that serves several requests at once is faster with more of them in flight. ``memory`` must
    be writable (that is how the local backend finds its address for direct I/O); nothing here
    writes to it. A file that fails is aborted (removed); once the others have ended, the first
    error (in file order) propagates. ``progress`` hears of every write and every file made
    durable (the writer process reports it, so that its parent can tell a slow write from a hung one).
    """
    for w in writes:
        for p in w.pieces:
            if p.offset < 0 or p.offset + p.nbytes > len(memory):
                raise ValueError(
                    f"{w.name}: the bytes of {p.key!r} ([{p.offset}, {p.offset + p.nbytes})) lie outside the "
                    f"staging memory ({len(memory)} bytes)"
                )
    n = min(len(writes), storage.write_streams if streams is None else streams)
    sums: dict[str, tuple[str, ...]] = {}
    if n <= 1:
        for w in writes:
            sums.update(_write_file(storage, w, memory, block, progress))
        return sums
    futures: list[cf.Future[dict[str, tuple[str, ...]]]] = []
    with cf.ThreadPoolExecutor(max_workers=n, thread_name_prefix="stashpoint-write") as pool:
        for w in writes:
            futures.append(_runtime.submit_or_run(pool, _write_file, storage, w, memory, block, progress))
        cf.wait(futures)
    for f in futures:
        sums.update(f.result())
    return sums
