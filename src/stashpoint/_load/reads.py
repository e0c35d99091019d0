"""Reading a checkpoint's bytes into live tensors: which byte ranges, in parallel, verified.

Every (stored chunk, destination region) intersection is a piece. Whole chunks are read with
large vectored reads; partial chunks read only the byte ranges they need (whole checksum blocks
around them when verifying). :func:`fetch` reads and verifies every piece into buffers of its
own before anything lands in the live state; the faster :func:`execute_reads` reads whole chunks
straight into contiguous CPU destinations. Pieces bound for CUDA tensors are read into pageable
host buffers and copied to the device through a small ring of pinned buffers (``pinring``).
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import itertools
import os
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from stashpoint._core.format import (
    Manifest,
)
from stashpoint._core.reshard import Box
from stashpoint._load.arena import Arena
from stashpoint._load.manifest import shard_problem
from stashpoint._load.pieces import Piece, read_jobs
from stashpoint._load.pinring import PinnedRing, ring
from stashpoint._load.restoreplan import Read
from stashpoint._load.slotreads import SlotReads
from stashpoint._storage import Storage
from stashpoint._storage.oserror import read_failed
from stashpoint.errors import CheckpointError, CorruptCheckpointError


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


_READ_THREADS = 4


def _readers(storage: Storage) -> int:
    """Local files: no more readers than cores (a cached load is bound by memory and the GIL,
    and two more threads than a 2-core host has cost it 6 ms of 100; from its disk 1-4 readers
    were alike). Object storage: 4, each waiting on the network."""
    return max(1, min(_READ_THREADS, _cores())) if storage.local_reads else _READ_THREADS


def check_files(storage: Storage, manifest: Manifest, names: Iterable[str]) -> None:
    """Check that each shard exists with its recorded size and an intact header of this save."""
    files = {f.name: f for f in manifest.files}
    for name in sorted(set(names)):
        problem, _ = shard_problem(storage, manifest, files[name])
        if problem is not None:
            raise CorruptCheckpointError(problem)


def _gather(futures: list[cf.Future[None]], storage: Storage, errors: list[str]) -> None:
    for f in futures:
        e = f.exception()
        if isinstance(e, EOFError):  # a file shorter than its size said (cut while being read)
            e = CorruptCheckpointError(f"a shard of {storage.location} ended before its recorded size: {e}")
        if isinstance(e, OSError) and not isinstance(e, CheckpointError):
            e = read_failed(f"the checkpoint at {storage.location}", e)  # damage, or a cause to fix
            if not isinstance(e, CorruptCheckpointError):
                raise e
        if isinstance(e, CorruptCheckpointError):
            errors.append(str(e))
        elif e is not None:
            raise CheckpointError(f"reading the checkpoint at {storage.location} failed: {e}") from e


def plan_pieces(
    manifest: Manifest, reads: list[Read], *, shared_whole: bool = False, staged: bool = False
) -> list[Piece]:
    """Every (stored chunk, destination) intersection; raise if some wanted region is not stored.

    With ``shared_whole``, pieces of reads of a whole tensor are marked ``shared``: other ranks
    on this host read those too (replicated tensors). With ``staged``, every piece gets a buffer
    of its own (no destination is read into)."""
    pieces: list[Piece] = []
    seen: set[tuple[object, ...]] = set()
    missing = []
    for r in reads:  # tied destinations that share memory are read once
        sig = (r.key, r.dest.data_ptr(), r.dest.shape, r.dest.stride(), r.dest.device, r.region)
        if r.region.numel == 0 or sig in seen:
            continue
        seen.add(sig)
        found = [p for c in manifest.tensors[r.key].chunks if (p := Piece.make(r.key, c, r, staged)) is not None]
        if shared_whole and r.region == Box.whole(manifest.tensors[r.key].shape):
            for p in found:
                p.shared = True
        if sum(p.inter.numel for p in found) != r.region.numel:
            missing.append(f"{r.key!r} {r.region}")
        pieces.extend(found)
    _bounce_shared(pieces)
    if missing:
        raise CorruptCheckpointError(
            f"the checkpoint does not hold every part of: {', '.join(missing[:5])}; some rank's shards are missing"
        )
    return pieces


def _bounce_shared(pieces: list[Piece]) -> None:
    """Destinations that share memory under different keys (a tied model loading an untied
    checkpoint) must not be read into concurrently: all but the first go through a buffer."""
    spans = []
    for p in pieces:
        if p.buf is p.target and p.target.numel():
            lo = p.target.data_ptr()
            spans.append((lo, lo + p.target.numel() * p.target.element_size()))
    ordered = sorted(spans)
    # spans that overlap at all overlap a neighbour in start order: usually none do (n log n)
    if all(a[1] <= b[0] for a, b in itertools.pairwise(ordered)):
        return
    # The spans kept are disjoint: sorted by start, each new one is checked against its two
    # neighbours only (checking against all was quadratic; inserting is, in the tied few).
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


def execute_reads(
    storage: Storage, manifest: Manifest, reads: list[Read], *, verify: bool, ranks_share_host: bool = False
) -> None:
    """Read every needed byte range in parallel (large vectored reads for whole chunks), verify
    checksums, and place the data; one error lists every damaged key.

    ``ranks_share_host``: other ranks on this host load the same checkpoint, each reading what
    it needs; whole tensors (replicated: every rank reads them) are then read through the page
    cache (``storage.shared_reads()``), the rest (shards: one reader each) as ``storage`` reads.
    """
    run_reads(storage, prepare_reads(storage, manifest, reads, ranks_share_host=ranks_share_host), verify=verify)


def prepare_reads(
    storage: Storage, manifest: Manifest, reads: list[Read], *, ranks_share_host: bool = False
) -> list[Piece]:
    """:func:`execute_reads`' pieces, their shards checked (present, whole, of this save);
    nothing read into a destination yet."""
    pieces = plan_pieces(manifest, reads, shared_whole=ranks_share_host)
    check_files(storage, manifest, (p.chunk.file for p in pieces))
    return pieces


def run_reads(storage: Storage, pieces: list[Piece], *, verify: bool) -> None:
    """Read, verify and place the pieces :func:`prepare_reads` gave."""
    try:
        _execute_pipelined(storage, pieces, verify, place=True)
    finally:
        # bytes read straight into a tensor's memory bypass autograd's count of in-place
        # changes: a graph still holding the tensor must fail at backward(), as after copy_()
        torch.autograd.graph.increment_version([p.target for p in pieces if p.buf is p.target])


@dataclass
class Fetched:
    """Every piece of a load, read and verified into buffers of its own; nothing placed yet."""

    pieces: list[Piece]

    def land(self) -> None:
        """Copy every piece into its destination (CUDA ones through the pinned ring, waited for)."""
        with _ring_for(self.pieces) as pinned:
            for p in self.pieces:
                p.place(pinned)


def fetch(
    storage: Storage, manifest: Manifest, reads: list[Read], *, verify: bool, ranks_share_host: bool = False
) -> Fetched:
    """:func:`execute_reads` without touching any destination: every byte is read and verified
    into buffers of the load's own, so a load that fails leaves the live state as it was;
    :meth:`Fetched.land` then places it all."""
    pieces = plan_pieces(manifest, reads, shared_whole=ranks_share_host, staged=True)
    check_files(storage, manifest, (p.chunk.file for p in pieces))
    with Arena(pieces):
        _execute_pipelined(storage, pieces, verify, place=False)
    return Fetched(pieces)


def _execute_pipelined(storage: Storage, pieces: list[Piece], verify: bool, place: bool = True) -> None:
    """Read, verify and (with ``place``) place every piece. A piece bound for a CUDA tensor is
    read into host memory and verified, and copied to the device through the pinned ring as soon
    as it is ready (asynchronously, on a side stream), while later reads go on; CPU destinations are
    placed at the end. A load that fails part-way may then leave some destinations already
    written (pieces read straight into CPU tensors, CUDA pieces already verified).

    A whole piece bound for a contiguous CUDA tensor skips host memory of its own: readers fill
    the ring's pinned slots with it, one slot-sized segment at a time, each verified block by
    block, and each slot goes on to the device (``SlotReads``)."""
    errors: list[str] = []
    with (
        _ring_for(pieces if place else []) as pinned,
        cf.ThreadPoolExecutor(max_workers=_readers(storage), thread_name_prefix="stashpoint-reader") as pool,
    ):
        direct = SlotReads.pieces(pieces) if pinned is not None else []
        skip = {id(p) for p in direct}
        jobs = read_jobs([p for p in pieces if p.whole and id(p) not in skip], apart=storage.local_reads)
        index = {id(p): i for i, p in enumerate(pieces)}
        left: dict[int, int] = {}  # piece -> its read jobs still running
        for job in jobs:
            for owner in set(job.owners):
                left[index[owner]] = left.get(index[owner], 0) + 1
        what: dict[cf.Future[None], tuple[str, list[int]]] = {}
        sharing = any(j.shared for j in jobs) or any(p.shared for p in direct)
        shared = storage.shared_reads() if sharing else storage
        for job in jobs:
            members = sorted({index[o] for o in job.owners})
            what[pool.submit(job.run, shared if job.shared else storage, verify)] = ("read", members)
        for i, p in enumerate(pieces):
            if not p.whole:  # read_partial verifies as it reads
                what[pool.submit(p.read_partial, storage, verify)] = ("ready", [i])
        slots = SlotReads(direct, pinned, storage, shared, verify) if pinned is not None and direct else None
        pending = set(what)
        if slots is not None:
            pending |= slots.feed(pool)
        while pending:
            done, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            for f in done:
                if slots is not None and f in slots.inflight:
                    if (e := slots.landed(f, errors)) is not None:
                        _gather([e], storage, errors)
                    pending |= slots.feed(pool) if not errors else set()
                    continue
                kind, members = what.pop(f)
                if f.exception() is not None:
                    _gather([f], storage, errors)
                    continue
                if kind == "read":  # verified as read (``_ReadJob.run``)
                    members = [m for m in members if _finished(left, m)]
                for m in members:
                    if pinned is not None and not errors and pieces[m].target.device.type == "cuda":
                        pieces[m].place(pinned)
    if errors:  # a piece read by several jobs may be named by more than one
        raise CorruptCheckpointError("\n".join(dict.fromkeys("\n".join(errors).split("\n"))))
    for p in pieces if place else ():
        if p.target.device.type != "cuda":
            p.place()


def _finished(left: dict[int, int], piece: int) -> bool:
    left[piece] -= 1
    return left[piece] == 0


def _ring_for(pieces: list[Piece]) -> AbstractContextManager[PinnedRing | None]:
    """The process's pinned ring, held for this load, if some piece is bound for a CUDA tensor."""
    if any(p.target.device.type == "cuda" for p in pieces):
        return ring().session()
    return nullcontext()
