"""Reading a checkpoint's bytes into live tensors: which byte ranges, in parallel, verified.

Every (stored chunk, destination region) intersection is a piece. Whole chunks are read with
large vectored reads; partial chunks read only the byte ranges they need (whole checksum blocks
around them when verifying). :func:`fetch` reads and verifies every piece into buffers of its
own (pinned for CUDA destinations) before anything lands in the live state; the faster
:func:`execute_reads` reads whole chunks straight into contiguous CPU destinations.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import mmap
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from stashpoint._core.format import (
    CHECKSUM_BLOCK_BYTES,
    Chunk,
    Manifest,
    block_checksums,
    checksum,
)
from stashpoint._core.reshard import Box, block_spans, intersect, local, runs
from stashpoint._load.manifest import shard_problem
from stashpoint._load.restore import Read
from stashpoint._save.staging import as_memoryview
from stashpoint._storage import Storage
from stashpoint.errors import CheckpointError, CorruptCheckpointError

_READ_THREADS = 4


def check_files(storage: Storage, manifest: Manifest, names: Iterable[str]) -> None:
    """Check that each shard exists with its recorded size and an intact header of this save."""
    files = {f.name: f for f in manifest.files}
    for name in sorted(set(names)):
        problem, _ = shard_problem(storage, manifest, files[name])
        if problem is not None:
            raise CorruptCheckpointError(problem)


_JOB_BYTES = 64 * 1024 * 1024
_JOB_BUFFERS = 256


@dataclass
class _Piece:
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
    def make(cls, key: str, chunk: Chunk, read: Read, staged: bool = False) -> _Piece | None:
        cbox = Box(chunk.offsets, chunk.shape)
        inter = intersect(cbox, read.region)
        if inter is None:
            return None
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
        # CUDA destinations get pinned bounce buffers: their copies to the device are asynchronous
        pin = view.device.type == "cuda"
        buf = view if direct else torch.empty(inter.shape, dtype=view.dtype, pin_memory=pin)
        return cls(key, chunk, inter, view, buf, whole, as_memoryview(buf), buf.element_size())

    def bad(self, storage: Storage) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"checksum mismatch for key {self.key!r} in shard {storage.location}/{self.chunk.file}: the "
            "data is damaged. Load an earlier checkpoint or a copy of this one."
        )

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

    def verify(self, storage: Storage) -> None:
        if self.whole and block_checksums(self.mv) != self.chunk.checksums:
            raise self.bad(storage)

    def place(self) -> None:
        if self.buf is not self.target:
            with torch.no_grad():  # the destination may be a view of a parameter
                self.target.copy_(self.buf, non_blocking=self.buf.is_pinned())

    def bounce(self) -> None:
        """Read into a buffer of its own (its destination shares memory with another's)."""
        if self.buf is self.target:
            self.buf = torch.empty(self.inter.shape, dtype=self.target.dtype)
            self.mv = as_memoryview(self.buf)


@dataclass
class _ReadJob:
    """One vectored read: a contiguous byte range of a file into a list of buffers."""

    file: str
    offset: int
    size: int
    buffers: list[memoryview]
    keys: list[str]
    owners: list[int]  # id() of the piece of each buffer
    shared: bool = False  # of pieces other ranks on this host read too

    def run(self, storage: Storage) -> None:
        try:
            storage.readv(self.file, self.offset, self.buffers)
        except EOFError as e:
            keys = ", ".join(repr(k) for k in sorted(set(self.keys))[:5])
            raise CorruptCheckpointError(
                f"shard {storage.location}/{self.file} is truncated inside {keys}: {e}"
            ) from None


def _read_jobs(pieces: list[_Piece]) -> list[_ReadJob]:
    """Coalesce whole-chunk reads of adjacent byte ranges into large vectored reads."""
    jobs: list[_ReadJob] = []
    for p in sorted(pieces, key=lambda p: (p.chunk.file, p.chunk.start)):
        mv = p.mv
        for b in range(0, len(mv), _JOB_BYTES):
            part = mv[b : b + _JOB_BYTES]
            last = jobs[-1] if jobs else None
            if (
                last is not None
                and last.file == p.chunk.file
                and last.shared == p.shared
                and last.offset + last.size == p.chunk.start + b
                and last.size + len(part) <= _JOB_BYTES
                and len(last.buffers) < _JOB_BUFFERS
            ):
                last.buffers.append(part)
                last.keys.append(p.key)
                last.owners.append(id(p))
                last.size += len(part)
            else:
                jobs.append(_ReadJob(p.chunk.file, p.chunk.start + b, len(part), [part], [p.key], [id(p)], p.shared))
    return jobs


def _gather(futures: list[cf.Future[None]], storage: Storage, errors: list[str]) -> None:
    for f in futures:
        e = f.exception()
        if isinstance(e, CorruptCheckpointError):
            errors.append(str(e))
        elif e is not None:
            raise CheckpointError(f"reading the checkpoint at {storage.location} failed: {e}") from e


def plan_pieces(
    manifest: Manifest, reads: list[Read], *, shared_whole: bool = False, staged: bool = False
) -> list[_Piece]:
    """Every (stored chunk, destination) intersection; raise if some wanted region is not stored.

    With ``shared_whole``, pieces of reads of a whole tensor are marked ``shared``: other ranks
    on this host read those too (replicated tensors). With ``staged``, every piece gets a buffer
    of its own (no destination is read into)."""
    pieces: list[_Piece] = []
    seen: set[tuple[str, int, tuple[int, ...], tuple[int, ...], str, Box]] = set()
    missing = []
    for r in reads:  # tied destinations that share memory are read once
        sig = (r.key, r.dest.data_ptr(), tuple(r.dest.shape), r.dest.stride(), str(r.dest.device), r.region)
        if r.region.numel == 0 or sig in seen:
            continue
        seen.add(sig)
        found = [p for c in manifest.tensors[r.key].chunks if (p := _Piece.make(r.key, c, r, staged)) is not None]
        if shared_whole and r.region == Box.whole(manifest.tensors[r.key].shape):
            for p in found:
                p.shared = True
        if sum(p.inter.numel for p in found) != r.region.numel:
            missing.append(f"{r.key!r} {r.region}")
        pieces.extend(found)
    # Destinations that share memory under different keys (a tied model loading an untied
    # checkpoint) must not be read into concurrently: all but the first go through a buffer.
    # The spans kept are disjoint: sorted by start, each new one is checked against its two
    # neighbours only (n log n, where checking against all was quadratic).
    starts: list[int] = []
    ends: list[int] = []
    for p in pieces:
        if p.buf is p.target and p.target.numel():
            lo = p.target.data_ptr()
            hi = lo + p.target.numel() * p.target.element_size()
            i = bisect.bisect_right(starts, lo)
            if (i > 0 and ends[i - 1] > lo) or (i < len(starts) and starts[i] < hi):
                p.bounce()
            else:
                starts.insert(i, lo)
                ends.insert(i, hi)
    if missing:
        raise CorruptCheckpointError(
            f"the checkpoint does not hold every part of: {', '.join(missing[:5])}; some rank's shards are missing"
        )
    return pieces


def execute_reads(
    storage: Storage, manifest: Manifest, reads: list[Read], *, verify: bool, ranks_share_host: bool = False
) -> None:
    """Read every needed byte range in parallel (large vectored reads for whole chunks), verify
    checksums, and place the data; one error lists every damaged key.

    ``ranks_share_host``: other ranks on this host load the same checkpoint, each reading what
    it needs; whole tensors (replicated: every rank reads them) are then read through the page
    cache (``storage.shared_reads()``), the rest (shards: one reader each) as ``storage`` reads.
    """
    pieces = plan_pieces(manifest, reads, shared_whole=ranks_share_host)
    check_files(storage, manifest, (p.chunk.file for p in pieces))
    _execute_pipelined(storage, pieces, verify, place=True)


@dataclass
class Fetched:
    """Every piece of a load, read and verified into buffers of its own; nothing placed yet."""

    pieces: list[_Piece]

    def land(self) -> None:
        """Copy every piece into its destination (CUDA ones on a side stream, waited for)."""
        streams: dict[torch.device, torch.cuda.Stream] = {}
        for p in self.pieces:
            if p.target.device.type == "cuda":
                _place_on_side_stream(p, streams)
            else:
                p.place()
        for stream in streams.values():
            stream.synchronize()


def fetch(
    storage: Storage, manifest: Manifest, reads: list[Read], *, verify: bool, ranks_share_host: bool = False
) -> Fetched:
    """:func:`execute_reads` without touching any destination: every byte is read and verified
    into buffers of the load's own, so a load that fails leaves the live state as it was;
    :meth:`Fetched.land` then places it all."""
    pieces = plan_pieces(manifest, reads, shared_whole=ranks_share_host, staged=True)
    check_files(storage, manifest, (p.chunk.file for p in pieces))
    with _Arena(pieces):
        _execute_pipelined(storage, pieces, verify, place=False)
    return Fetched(pieces)


class _Arena:
    """One mapping for the host buffers of a fetch's CPU-bound pieces, laid out in read order,
    its pages populated by a thread that keeps ahead of the readers: a fetch faults in as many
    fresh pages as it reads bytes, and this takes most of that work off the readers' path."""

    _POPULATE_WRITE = 23  # MADV_POPULATE_WRITE (Linux 5.14)
    _STEP = 32 << 20

    def __init__(self, pieces: list[_Piece]) -> None:
        mine = sorted((p for p in pieces if p.buf.device.type == "cpu" and not p.buf.is_pinned()),
                      key=lambda p: (p.chunk.file, p.chunk.start))
        sizes = [-(-p.buf.numel() * p.itemsize // 4096) * 4096 for p in mine]
        self.total = sum(sizes)
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        if self.total < self._STEP:
            return
        self.map = mmap.mmap(-1, self.total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(self.map, dtype=torch.uint8)
        at = 0
        for p, n in zip(mine, sizes):
            p.buf = whole[at : at + p.buf.numel() * p.itemsize].view(p.buf.dtype).view(p.buf.shape)
            p.mv = as_memoryview(p.buf)
            at += n
        self.thread = threading.Thread(target=self._populate, name="stashpoint-populate", daemon=True)

    def _populate(self) -> None:
        for off in range(0, self.total, self._STEP):
            if self.stop.is_set():
                return
            try:
                self.map.madvise(self._POPULATE_WRITE, off, min(self._STEP, self.total - off))
            except (OSError, ValueError):  # an older kernel: the readers fault the pages in
                return

    def __enter__(self) -> _Arena:
        if self.thread is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()


def _execute_pipelined(storage: Storage, pieces: list[_Piece], verify: bool, place: bool = True) -> None:
    """Read, verify and (with ``place``) place every piece. A piece bound for a CUDA tensor is
    read into pinned memory and verified, and its copy to the device is issued (asynchronously,
    on a side stream) as soon as it is ready, while later reads go on; CPU destinations are
    placed at the end. A load that fails part-way may then leave some destinations already
    written (pieces read straight into CPU tensors, CUDA pieces already verified)."""
    jobs = _read_jobs([p for p in pieces if p.whole])
    index = {id(p): i for i, p in enumerate(pieces)}
    left: dict[int, int] = {}  # piece -> its read jobs still running
    for job in jobs:
        for owner in set(job.owners):
            left[index[owner]] = left.get(index[owner], 0) + 1
    errors: list[str] = []
    streams: dict[torch.device, torch.cuda.Stream] = {}
    with cf.ThreadPoolExecutor(max_workers=_READ_THREADS, thread_name_prefix="stashpoint-reader") as pool:
        what: dict[cf.Future[None], tuple[str, list[int]]] = {}
        shared = storage.shared_reads() if any(j.shared for j in jobs) else storage
        for job in jobs:
            members = sorted({index[o] for o in job.owners})
            what[pool.submit(job.run, shared if job.shared else storage)] = ("read", members)
        for i, p in enumerate(pieces):
            if not p.whole:  # read_partial verifies as it reads
                what[pool.submit(p.read_partial, storage, verify)] = ("ready", [i])
        pending = set(what)
        while pending:
            done, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            for f in done:
                kind, members = what.pop(f)
                if f.exception() is not None:
                    _gather([f], storage, errors)
                    continue
                if kind == "read":
                    members = [m for m in members if _finished(left, m)]
                    if verify:
                        for m in members:
                            nf = pool.submit(pieces[m].verify, storage)
                            what[nf] = ("ready", [m])
                            pending.add(nf)
                        continue
                for m in members:
                    if place and not errors and pieces[m].target.device.type == "cuda":
                        _place_on_side_stream(pieces[m], streams)
    for stream in streams.values():
        stream.synchronize()
    if errors:
        raise CorruptCheckpointError("\n".join(errors))
    for p in pieces if place else ():
        if p.target.device.type != "cuda":
            p.place()


def _finished(left: dict[int, int], piece: int) -> bool:
    left[piece] -= 1
    return left[piece] == 0


def _place_on_side_stream(p: _Piece, streams: dict[torch.device, torch.cuda.Stream]) -> None:
    from stashpoint._save.staging import side_stream

    device = p.target.device
    if device not in streams:
        streams[device] = side_stream(device)
        streams[device].wait_stream(torch.cuda.current_stream(device))  # after work queued on the targets
    with torch.cuda.stream(streams[device]):
        p.place()
