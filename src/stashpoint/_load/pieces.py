"""The pieces of a load: each (stored chunk, destination region) intersection, and the large
vectored reads that whole chunks are coalesced into, verified block by block as they land."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from stashpoint._core.format import CHECKSUM_BLOCK_BYTES, Chunk, checksum, running_checksum
from stashpoint._core.reshard import Box, block_spans, intersect, local, runs
from stashpoint._load.pinring import PinnedRing, writing
from stashpoint._load.restoreplan import Read
from stashpoint._state.dtypes import as_memoryview
from stashpoint._storage import Storage
from stashpoint.errors import CheckpointError, CorruptCheckpointError

_JOB_BYTES = 64 * 1024 * 1024
_JOB_BUFFERS = 256
# A cached block is read and checked in parts this size, each still in the core's own cache
# when checked (a 4 MiB block is not: 0.25 GB read and checked 0.072 s in 4 MiB steps, 0.056 s
# in 256 KiB ones, against 0.048 s read alone, on this 2 MiB-L2 host).
_PART = 256 * 1024
# Parts this small join a job after a gap, or read otherwise than the job (shared, or not):
# FSDP2's scalar step counts, saved once, sat between one rank's moments (cutting its reads
# into a job per tensor) and apart in the file for the other rank (149 jobs of 4 bytes each):
# a 2-rank cached load took half as long again.
_SMALL = 64 * 1024


@dataclass
class Piece:
    """The intersection of one stored chunk with one destination region, on its way in."""

    key: str
    chunk: Chunk
    inter: Box  # global coordinates
    target: torch.Tensor  # the destination's view of ``inter``
    buf: torch.Tensor  # where the bytes land: ``target`` itself, or a bounce buffer
    whole: bool  # the piece is the whole chunk (read and verified in one go)
    mv: memoryview  # ``buf``'s bytes. Reader threads touch only this: no torch calls off the
    # caller's thread (torch ops on short-lived threads have crashed process-group teardown)
    itemsize: int
    shared: bool = False  # other ranks on this host read the same bytes (read through the page cache)

    @classmethod
    def make(cls, key: str, chunk: Chunk, read: Read, staged: bool = False) -> Piece | None:
        cbox = Box(chunk.offsets, chunk.shape)
        inter = intersect(cbox, read.region)
        if inter is None:
            return None
        if inter == read.region:  # the whole destination (most reads): no view to make
            view = read.dest
        else:
            view = read.dest[tuple(slice(o, o + n) for o, n in zip(local(inter, read.region).offsets, inter.shape))]
        whole = inter == cbox
        direct = (
            not staged
            and whole
            and view.device.type == "cpu"
            and view.is_contiguous()
            and not view.is_conj()
            and not view.is_neg()
        )
        # CUDA destinations get pageable buffers too: only the ring their copies go through is pinned
        buf = view if direct else torch.empty(inter.shape, dtype=view.dtype)
        return cls(key, chunk, inter, view, buf, whole, as_memoryview(buf), buf.element_size())

    def bad(self, storage: Storage) -> CorruptCheckpointError:
        return CorruptCheckpointError(_damaged(self.key, storage, self.chunk.file))

    def read_partial(self, storage: Storage, verify: bool) -> None:
        """Read only the byte ranges of the chunk that hold ``inter`` (whole checksum blocks
        around them when verifying), then place them."""
        cbox = Box(self.chunk.offsets, self.chunk.shape)
        ranges = list(runs(cbox, self.inter, self.itemsize))
        out = self.mv
        total = self.chunk.end - self.chunk.start
        if not verify:
            pos = 0
            for b, e in ranges:
                storage.read_into(self.chunk.file, self.chunk.start + b, out[pos : pos + e - b])
                pos += e - b
            return
        pos = 0
        spans = block_spans(ranges, CHECKSUM_BLOCK_BYTES, total)
        for lo, hi in spans:
            span = bytearray(hi - lo)
            storage.read_into(self.chunk.file, self.chunk.start + lo, memoryview(span))
            for i in range(lo // CHECKSUM_BLOCK_BYTES, -(-hi // CHECKSUM_BLOCK_BYTES)):
                b0 = i * CHECKSUM_BLOCK_BYTES - lo
                if checksum(memoryview(span)[b0 : b0 + CHECKSUM_BLOCK_BYTES]) != self.chunk.checksums[i]:
                    raise self.bad(storage)
            for b, e in ranges:
                if lo <= b and e <= hi:
                    out[pos : pos + e - b] = memoryview(span)[b - lo : e - lo]
                    pos += e - b

    def place(self, pinned: PinnedRing | None = None) -> None:
        """Copy the buffer into the destination: through ``pinned`` if it is a CUDA tensor."""
        if self.buf is self.target:
            return
        if pinned is not None and self.target.device.type == "cuda":
            pinned.copy(self.target, self.buf)
            return
        with writing(self.target):
            self.target.copy_(self.buf)

    def bounce(self) -> None:
        """Read into a buffer of its own (its destination shares memory with another's)."""
        if self.buf is self.target:
            self.buf = torch.empty(self.inter.shape, dtype=self.target.dtype)
            self.mv = as_memoryview(self.buf)


def _damaged(key: str, storage: Storage, file: str) -> str:
    return (
        f"checksum mismatch for key {key!r} in shard {storage.location}/{file}: the "
        "data is damaged. Load an earlier checkpoint or a copy of this one."
    )


@dataclass
class ReadJob:
    """Vectored reads of one file into a list of buffers, each a whole chunk's bytes or a part
    of them that starts at one of its checksum blocks: a contiguous byte range, but for small
    buffers that may follow a gap (many small chunks apart in a file, read by one job)."""

    file: str
    offset: int
    size: int  # bytes read (the buffers'), not the span they lie in
    buffers: list[memoryview]
    keys: list[str]
    owners: list[int]  # id() of the piece of each buffer
    shared: bool = False  # of pieces other ranks on this host read too
    firsts: list[int] = field(default_factory=list)  # each buffer's first checksum block in its chunk
    sums: list[tuple[str, ...]] = field(default_factory=list)  # each buffer's chunk's block checksums
    starts: list[int] = field(default_factory=list)  # each buffer's offset in the file

    @property
    def end(self) -> int:
        """Where the last buffer's bytes end in the file."""
        return self.starts[-1] + len(self.buffers[-1]) if self.buffers else self.offset

    def add(self, part: memoryview, piece: Piece, start: int, first: int) -> None:
        self.buffers.append(part)
        self.keys.append(piece.key)
        self.owners.append(id(piece))
        self.firsts.append(first)
        self.sums.append(piece.chunk.checksums)
        self.starts.append(start)
        self.size += len(part)

    def run(self, storage: Storage, verify: bool = False) -> None:
        """Read it all, and with ``verify`` check every block. Bytes the host's cache holds are
        read a block at a time (small chunks' blocks together), each checked right after it
        lands, while it is still in the CPU's caches: checked in a second pass, a cached load
        took a third longer (the reads fill memory's bandwidth). From a disk, large reads keep
        its queue full and the check after each (64 MiB) read costs less than smaller reads."""
        # all of it cached: plain reads, without the residency probe a direct-I/O storage
        # makes before each read to take what is cached from the cache (a tenth of a cached
        # load). Pages evicted meanwhile cost speed, not correctness. Asked of the job's longest
        # run of bytes (the gaps are other ranks' bytes, cached or not), and of the storage the
        # job reads from (a view's is the copy under it).
        at, length = self._longest_run()
        src = storage.reads_for(self.file, at, length)
        plain = src.shared_reads() is src  # each read a plain one (a direct-I/O storage probes first)
        cached = verify and src.cached(self.file, at)
        bad: dict[str, None] = {}
        with src.reading(self.file) as readv:
            for pos, step in self._steps(CHECKSUM_BLOCK_BYTES if cached else self.end - self.offset):
                try:
                    if cached and plain and len(step) == 1 and len(step[0][0]) > _PART:
                        view, key, want = step[0]
                        if _read_checked(readv, pos, view) != want:
                            bad[key] = None
                        continue
                    readv(pos, [view for view, _, _ in step])
                except EOFError as e:
                    raise _truncated(storage, self.file, pos, step, e) from None
                if verify:
                    bad |= {key: None for view, key, want in step if checksum(view) != want}
        if bad:
            raise CorruptCheckpointError("\n".join(_damaged(k, storage, self.file) for k in bad))

    def _longest_run(self) -> tuple[int, int]:
        """Where the job's longest run of contiguous bytes starts, and its length."""
        best = (self.offset, 0)
        at = end = self.offset
        for start, buf in zip(self.starts, self.buffers, strict=True):
            if start != end:
                at = end = start
            end += len(buf)
            if end - at > best[1]:
                best = (at, end - at)
        return best

    def _steps(self, most: int) -> Iterator[tuple[int, list[tuple[memoryview, str, str]]]]:
        """The job's blocks (view, key, checksum) in file order, grouped into contiguous reads
        of at most ``most`` bytes (or one block), each with its offset in the file."""
        step: list[tuple[memoryview, str, str]] = []
        at = size = 0
        for buf, key, first, sums, start in zip(
            self.buffers, self.keys, self.firsts, self.sums, self.starts, strict=True
        ):
            for b in range(0, len(buf), CHECKSUM_BLOCK_BYTES):
                view = buf[b : b + CHECKSUM_BLOCK_BYTES]
                if step and (size + len(view) > most or at + size != start + b):
                    yield at, step
                    step, size = [], 0
                if not step:
                    at = start + b
                step.append((view, key, sums[first + b // CHECKSUM_BLOCK_BYTES]))
                size += len(view)
        if step:
            yield at, step


def _truncated(
    storage: Storage, file: str, pos: int, step: list[tuple[memoryview, str, str]], e: EOFError
) -> CorruptCheckpointError:
    """The error of a read from ``pos`` that the file's end cut: it names the keys past the end."""
    try:
        size: int | None = storage.size(file)
    except (OSError, CheckpointError):
        size = None
    cut, end = [], pos
    for view, key, _ in step:
        end += len(view)
        if size is None or end > size:
            cut.append(key)
    keys = list(dict.fromkeys(cut or [k for _, k, _ in step]))
    more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
    named = ", ".join(repr(k) for k in keys[:5])
    return CorruptCheckpointError(f"shard {storage.location}/{file} is truncated inside {named}{more}: {e}")


def _read_checked(readv: Callable[[int, Sequence[memoryview]], None], pos: int, view: memoryview) -> str:
    """Read ``view`` from ``pos`` a part at a time, and the checksum of it all."""
    summer = running_checksum()
    for b in range(0, len(view), _PART):
        part = view[b : b + _PART]
        readv(pos + b, [part])
        summer.update(part)
    return summer.hexdigest()


def _joins(job: ReadJob | None, piece: Piece, start: int, size: int, apart: bool) -> bool:
    """Whether ``size`` bytes of ``piece`` at ``start`` may be read by ``job``: the same file,
    right after its bytes (or, ``apart``, a small part after a gap), read alike (or the shared
    side small)."""
    if job is None or job.file != piece.chunk.file:
        return False
    if job.size + size > _JOB_BYTES or len(job.buffers) >= _JOB_BUFFERS:
        return False
    if job.end != start and (size > _SMALL or not apart):
        return False
    return job.shared == piece.shared or (size if piece.shared else job.size) <= _SMALL


def read_jobs(pieces: list[Piece], *, apart: bool = True) -> list[ReadJob]:
    """Coalesce whole-chunk reads of adjacent byte ranges into jobs of large vectored reads,
    and with ``apart`` small chunks apart in a file too: where each read is a call that costs
    little (local files), not a request with a network's latency (object storage: jobs run in
    parallel, a job's reads one after the other)."""
    jobs: list[ReadJob] = []
    for p in sorted(pieces, key=lambda p: (p.chunk.file, p.chunk.start)):
        mv = p.mv
        for b in range(0, len(mv), _JOB_BYTES):
            part = mv[b : b + _JOB_BYTES]
            last = jobs[-1] if jobs else None
            if last is None or not _joins(last, p, p.chunk.start + b, len(part), apart):
                last = ReadJob(p.chunk.file, p.chunk.start + b, 0, [], [], [], p.shared)
                jobs.append(last)
            elif last.shared != p.shared:  # a small shared part and an unshared one: read unshared
                last.shared = False
            last.add(part, p, p.chunk.start + b, b // CHECKSUM_BLOCK_BYTES)  # _JOB_BYTES: whole blocks
    return jobs
