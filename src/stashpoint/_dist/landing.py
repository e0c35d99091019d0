"""Where a transfer's bytes land: a node's step directory, written with direct I/O where the
file system allows it, each saving rank marked ``partial-r<rank>`` before any of its bytes
land and unmarked once its files are whole, the manifest committed last. So a crash or a
failure part-way leaves copies known as partial, never taken for whole ones."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from stashpoint._core.naming import MANIFEST_NAME, RECOVERABLE_NAME, split_group
from stashpoint._core.nodeplan import Transfer, expand
from stashpoint._dist.stream import Stream
from stashpoint._storage import LocalStorage, Storage
from stashpoint._storage.localwrite import LocalWriter, fsync_dir
from stashpoint.errors import CheckpointError


def partial_name(rank: int) -> str:
    """The marker of a saving rank whose files here are not all whole (fetched in part)."""
    return f"partial-r{rank:05d}"


def replica_name(rank: int) -> str:
    """The marker of a saving rank whose files here are a copy of another node's."""
    return f"replica-r{rank:05d}"


def mark_partial(step: Path, rank: int) -> None:
    """Mark saved rank ``rank``'s files in the step directory ``step`` as not whole (found
    damaged): not held here any more, and landed anew by the next fetch of them."""
    LocalStorage(step).commit(partial_name(rank), b"")


def adopt_replicas(step: Path, ranks: Iterable[int]) -> None:
    """Make this node's replicas of ``ranks`` in the step directory ``step`` its own files: they
    are the only copies left. The step no longer claims copies of every node's files elsewhere."""
    for r in ranks:
        (step / replica_name(r)).unlink(missing_ok=True)
    (step / RECOVERABLE_NAME).unlink(missing_ok=True)
    fsync_dir(step)


class Landing(LocalStorage):
    """A step directory that received files are written into with direct I/O (as saves write),
    without an fsync each unless ``durable`` (a replica is a recovery copy; a restore's fetch
    can be fetched again, and the load verifies every byte). Buffered writes were 4-5x slower
    on this project's test host (0.65 s against 0.12-0.17 s per 256 MiB) and hold the bytes in
    the page cache twice over a replica's life; the load that follows reads them directly.
    No space is reserved per file: the transfer checked the room for all of them first, and on
    a memory tier reserving zeroed every page once more before it was written."""

    def __init__(self, root: Path, *, durable: bool) -> None:
        super().__init__(root, cache_newest=False)
        self.durable = durable

    def open_writer(self, name: str, size: int) -> Any:
        parts = split_group(name)
        if parts is None or parts[0]:
            return super().open_writer(name, size)  # group directories: the usual path
        return LocalWriter(self.root / parts[1], size, direct=True, durable=self.durable, reserve=False)


def needed(files: Sequence[tuple[str, int]], t: Transfer) -> int:
    """The bytes a transfer of ``files`` and of ``t``'s byte ranges brings."""
    return sum(size for _, size in files) + sum(b - a for s in t.spans for a, b in s[3])


def land(step: Storage, t: Transfer, files: list[tuple[str, int]], stream: Stream, replica: bool) -> int:
    """Receive a transfer's ``files`` (whole, the manifest last) and byte ranges from ``stream``
    into this node's ``step``; the bytes it needed. The saving ranks it brings are marked
    partial before any byte lands and unmarked once whole (``replica``: marked as a copy of
    another node's, which a newer replica replaces). Nothing reserves the space: the caller
    checks the room for all of it first (a file system filled meanwhile fails the landing
    part-way, its ranks left marked partial)."""
    if isinstance(step, LocalStorage):  # direct writes, no fsync each unless a replica (Landing)
        step = Landing(step.root, durable=replica)
    whole, idx = expand(t.ranks), expand(t.indexes)
    try:
        step.prepare()
        # marked before any byte lands: a crash or a failure part-way leaves copies known as partial
        for r in whole | idx | {rank for _, rank, _, _ in t.spans}:
            step.commit(partial_name(r), b"")
        for r in whole if replica else ():
            step.commit(replica_name(r), b"")
    except (OSError, CheckpointError) as e:
        stream.error = e
    manifest: list[bytes] = []
    for name, size in files:
        if name == MANIFEST_NAME:
            stream.receive(name, [(0, size)], lambda _off, mv: manifest.append(bytes(mv)))
            continue
        out = _fresh_writer(step, name, size, stream)
        stream.receive(name, [(0, size)], lambda _off, mv, out=out: out.write(mv) if out is not None else None)
        if out is not None:
            if stream.error is None:
                out.close()
            else:
                out.abort()
    for span in t.spans:
        _recv_sparse(stream, step, span)
    stream.done_receiving()  # the sender's errors too: zeros sent for a read that failed are no copy
    step.sync()
    for r in whole:  # whole copies now (also where an earlier restore had fetched parts)
        step.delete(partial_name(r))
    if manifest:
        step.commit(MANIFEST_NAME, b"".join(manifest))
    return needed(files, t)


def _fresh_writer(step: Storage, name: str, size: int, stream: Stream) -> Any:
    if stream.error is not None:
        return None
    try:
        step.delete(name)  # a part left by an interrupted transfer, or a sparse copy
        return step.open_writer(name, size)
    except (OSError, CheckpointError) as e:
        stream.error = e
        return None


def _recv_sparse(stream: Stream, step: Storage, span: Any) -> None:
    """Byte ranges of a file (``span``: name, rank, size, ranges) into a copy of its full
    size (the rest a hole), on local disk."""
    name, _, size, spans = span
    fd = -1
    if stream.error is None and (not isinstance(step, LocalStorage) or split_group(name) is None):
        stream.error = CheckpointError(f"node-local directories are local; {step.location} is not")
    if stream.error is None:
        assert isinstance(step, LocalStorage)
        try:
            fd = step.open_sparse(name, size)
        except (OSError, CheckpointError) as e:
            stream.error = e
    try:
        stream.receive(name, spans, lambda off, mv: os.pwrite(fd, mv, off) if fd >= 0 else None)
        if fd >= 0 and stream.error is None:
            os.fsync(fd)
    finally:
        if fd >= 0:
            os.close(fd)
