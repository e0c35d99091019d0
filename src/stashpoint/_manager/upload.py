"""What a rank copies to the remote tier, and the copy itself, checked against the checkpoint's
checksums as it goes: a local copy damaged since its save must fail its upload, not replace a
good remote step under the remote retention. And what rank 0 decides from every rank's view
before an upload."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from stashpoint._core.format import CHECKSUM_BLOCK_BYTES, Chunk, FileEntry, Manifest, checksum
from stashpoint._load.manifest import read_head, read_index
from stashpoint._storage import Storage
from stashpoint._storage.oserror import says_damage
from stashpoint.errors import CheckpointError, CorruptCheckpointError

log = logging.getLogger("stashpoint")

COPY_BLOCK = 64 * 1024 * 1024

#: Checked bytes of a file: ``(start, end, the checksum of each ``block`` bytes of them, block)``.
Span = tuple[int, int, tuple[str, ...], int]


@dataclass(frozen=True)
class Upload:
    """One file to copy: its bytes where they were read (and checked) already, else the
    spans to check while copying it."""

    name: str
    size: int
    spans: tuple[Span, ...] = ()
    data: bytes | None = None


def own_files(src: Storage, rank: int, world: int, saved: Iterable[int] | None = None) -> list[Upload]:
    """The files of the checkpoint at ``src`` this rank uploads: those of the saved ranks
    ``saved`` (default: those ``s`` with ``s % world == rank``, its own when the world is the one
    that saved), each with its index; a version-1 checkpoint's files go by the rank the manifest
    names."""
    head = read_head(src)
    if isinstance(head, Manifest):
        spans = _spans(head.files, (c for e in head.tensors.values() for c in e.chunks))
        return [Upload(f.name, f.size, tuple(spans.get(f.name, ()))) for f in head.files if f.rank % world == rank]
    out = []
    for saved_rank in range(rank, head.world_size, world) if saved is None else sorted(saved):
        index = read_index(src, head, saved_rank)
        spans = _spans(index.files, index.chunks.values())
        out += [Upload(f.name, f.size, tuple(spans.get(f.name, ()))) for f in index.files]
        name, (size, sums) = head.index_name(saved_rank), head.indexes[saved_rank]
        raw = _read(src, name, 0, size)
        if checksum(raw) != sums:  # read again: it may have changed since it was parsed
            raise CorruptCheckpointError(f"{src.location}/{name} does not match the manifest's checksum: not uploaded")
        out.append(Upload(name, size, data=raw))
    return out


def rank_problem(src: Storage, saved: int) -> str | None:
    """What is wrong with saved rank ``saved``'s files in the step directory ``src`` (its index
    against the manifest, every block of its shards against the index), or None when they are
    whole (or could not be checked for a cause that is no sign of damage: memory, permissions):
    reads them all."""
    try:
        head = read_head(src)
        if isinstance(head, Manifest):  # version 1: no rank's files stand alone
            return None
        index = read_index(src, head, saved)
        spans = _spans(index.files, index.chunks.values())
        for f in index.files:
            if src.size(f.name) != f.size:  # cut short, or grown (a copy would carry every byte)
                return f"{src.location}/{f.name} holds {src.size(f.name)} bytes where its index says {f.size}"
            for _ in _checked(src, f.name, f.size, spans.get(f.name, ())):
                pass
    except (OSError, CheckpointError) as e:  # unreadable here (EIO, missing) is damaged here
        if not says_damage(e):  # memory, permissions, the open-file limit: no sign of damage
            log.warning("stashpoint: could not check rank %d's files in %s: %s", saved, src.location, e)
            return None
        return f"{type(e).__name__}: {e}"
    return None


def _spans(files: Iterable[FileEntry], chunks: Iterable[Chunk]) -> dict[str, list[Span]]:
    """Each file's checked spans: its header (one checksum) and its chunks (one per block)."""
    by_file: dict[str, list[Span]] = {f.name: [(0, f.data_start, (f.header_checksum,), f.data_start)] for f in files}
    for c in chunks:
        by_file.setdefault(c.file, []).append((c.start, c.end, c.checksums, CHECKSUM_BLOCK_BYTES))
    return by_file


def copy_file(src: Storage, dst: Storage, up: Upload) -> None:
    """Copy ``up`` from ``src`` to ``dst``, checked as it goes; raises ``CorruptCheckpointError``
    at the first mismatch (the copy is aborted)."""
    writer = dst.open_writer(up.name, up.size)
    try:
        try:
            for block in (up.data,) if up.data is not None else _checked(src, up.name, up.size, up.spans):
                writer.write(block)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"{e}: not uploaded") from None
        writer.close()
    except BaseException:
        writer.abort()
        raise


def _checked(src: Storage, name: str, size: int, spans: Iterable[Span]) -> Iterator[bytes]:
    """The ``size`` bytes of ``name`` in order: large blocks between the checked spans, and
    within them each checksum block, checked (``CorruptCheckpointError`` at the first that is
    not what the index says)."""
    pos = 0
    for start, end, sums, size_of_block in sorted(set(spans)):
        if start < pos:  # the same bytes named twice (tied tensors): checked once
            continue
        yield from _unchecked(src, name, pos, start)
        for k, lo in enumerate(range(start, max(end, start + 1), max(1, size_of_block))):
            block = _read(src, name, lo, min(lo + size_of_block, end))
            if k >= len(sums) or checksum(block) != sums[k]:
                raise CorruptCheckpointError(
                    f"{src.location}/{name} does not match its checksums at bytes {lo}-{lo + len(block)} (damaged "
                    "since it was saved)"
                )
            yield block
        pos = max(pos, end)
    yield from _unchecked(src, name, pos, size)


def _read(src: Storage, name: str, lo: int, hi: int) -> bytes:
    block = src.read(name, lo, hi - lo)
    if len(block) != hi - lo:
        raise CorruptCheckpointError(f"{src.location}/{name} ended at byte {lo + len(block)} of {hi} (cut short)")
    return block


def _unchecked(src: Storage, name: str, lo: int, hi: int) -> Iterator[bytes]:
    for at in range(lo, hi, COPY_BLOCK):
        yield _read(src, name, at, min(at + COPY_BLOCK, hi))


@dataclass(frozen=True)
class UploadStart:
    """A rank's view before an upload: kind "skip" (detail: why), "done", "ok" or "error"
    (detail: why)."""

    seq: int
    step: int
    kind: str
    detail: Any
    held: tuple[tuple[int, int], ...] | None = None  # node-local: the saved ranks its node holds whole


def decide(starts: Sequence[UploadStart]) -> tuple[str, Any]:
    """Rank 0: what every rank does about an upload, from every rank's view of it."""
    if len({(u.seq, u.step) for u in starts}) > 1:
        odd = [(r, u) for r, u in enumerate(starts) if (u.seq, u.step) != (starts[0].seq, starts[0].step)]
        seen = ", ".join(f"rank {r}: upload #{u.seq} of step {u.step}" for r, u in [(0, starts[0]), *odd[:8]])
        return ("broken", f"the ranks' uploads are out of step ({seen})")
    if any(u.kind == "skip" for u in starts):
        return ("skip", None)
    return (starts[0].kind, starts[0].detail)
