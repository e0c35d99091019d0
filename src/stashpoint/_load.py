"""load: read a committed checkpoint straight into the tensors of a live state."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from . import _dist
from ._dist import rank_of
from ._exchange import Item, agree, assign_readers, broadcast_shares
from ._format import (
    CHECKSUM_BLOCK_BYTES,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    Chunk,
    FileEntry,
    Manifest,
    block_checksums,
    checksum,
    parse_header,
    parse_manifest,
)
from ._policy import parse_step_dir
from ._reshard import Box, block_spans, intersect, local, runs
from ._restore import Planner, Read
from ._staging import as_memoryview
from ._storage import LocalStorage, Storage, storage_for
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StateMismatchError,
)

log = logging.getLogger("stashpoint")

_READ_THREADS = 4


def read_manifest(storage: Storage) -> Manifest:
    """Read and validate the manifest of the checkpoint at ``storage``."""
    loc = storage.location
    if isinstance(storage, LocalStorage) and storage.root.is_file():
        raise CheckpointError(
            f"{loc} is a file, not a stashpoint checkpoint directory. To convert a torch.save file, "
            "load it with torch.load(weights_only=True) and save the result with stashpoint.save."
        )
    try:
        if storage.size(MANIFEST_NAME) > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(f"the manifest of {loc} is larger than the {MAX_MANIFEST_BYTES} byte cap")
        raw = storage.read(MANIFEST_NAME)
    except FileNotFoundError:
        names = storage.list() + storage.children() if storage.exists(None) else []
        if any(parse_step_dir(n) is not None for n in names):
            raise CheckpointError(
                f"{loc} is a run directory of step checkpoints, not one checkpoint; pass a step directory "
                "(e.g. the newest), or use CheckpointManager(...).restore(state)"
            ) from None
        ours = [n for n in names if n.startswith("shard-") or n.startswith(f".{MANIFEST_NAME}")]
        if names and not ours:
            raise CheckpointError(
                f"{loc} is not a stashpoint checkpoint (no {MANIFEST_NAME} and no shard files); check the path"
            ) from None
        if storage.exists(None):
            raise IncompleteCheckpointError(
                f"{loc} exists but holds no committed checkpoint (no {MANIFEST_NAME}): the save that "
                "wrote it did not finish. Load an earlier checkpoint, or delete this directory."
            ) from None
        raise CheckpointNotFoundError(f"no checkpoint at {loc}: the path does not exist") from None
    return parse_manifest(raw, f"{loc}/{MANIFEST_NAME}")


def unlisted_shards(storage: Storage, manifest: Manifest) -> list[str]:
    """Shard files of *this* save that its manifest does not list: the manifest lost entries.

    (Shards of other saves — leftovers of an interrupted overwrite — are not part of the
    checkpoint and do not count.)"""
    listed = {f.name for f in manifest.files}
    tail = f"-{manifest.save_id}.safetensors"
    return sorted(n for n in storage.list() if n.startswith("shard-") and n.endswith(tail) and n not in listed)


def check_files(storage: Storage, manifest: Manifest, names: Iterable[str]) -> None:
    """Check that each shard exists with its recorded size and an intact header of this save."""
    files = {f.name: f for f in manifest.files}
    held: dict[str, list[str]] = {}
    for key, entry in manifest.tensors.items():
        for c in entry.chunks:
            held.setdefault(c.file, []).append(key)
    for name in sorted(set(names)):
        fe: FileEntry = files[name]
        keys = held.get(name, [])
        shown = ", ".join(repr(k) for k in keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
        where = f"{storage.location}/{name} (holding {shown or 'no tensor'})"
        try:
            size = storage.size(name)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"shard {where} listed in the manifest is missing") from None
        except OSError as e:
            raise CorruptCheckpointError(f"shard {where} is refused: {e.strerror or e}") from None
        if size != fe.size:
            what = "truncated" if size < fe.size else "larger than recorded"
            raise CorruptCheckpointError(f"shard {where} is {what}: {size} bytes, the manifest says {fe.size}")
        head = storage.read(name, 0, fe.data_start)
        if checksum(head) != fe.header_checksum:
            raise CorruptCheckpointError(
                f"the header of shard {where} does not match the manifest (damaged, or from another save)"
            )
        doc = parse_header(head, size, where)
        meta = doc.get("__metadata__", {})
        if not isinstance(meta, dict) or meta.get("save_id") != manifest.save_id:
            raise CorruptCheckpointError(f"shard {where} belongs to another save than its manifest")


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

    @classmethod
    def make(cls, key: str, chunk: Chunk, read: Read) -> _Piece | None:
        cbox = Box(chunk.offsets, chunk.shape)
        inter = intersect(cbox, read.region)
        if inter is None:
            return None
        view = read.dest[tuple(slice(o, o + n) for o, n in zip(local(inter, read.region).offsets, inter.shape))]
        whole = inter == cbox
        direct = (
            whole and view.device.type == "cpu" and view.is_contiguous() and not view.is_conj() and not view.is_neg()
        )
        buf = view if direct else torch.empty(inter.shape, dtype=view.dtype)
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
                self.target.copy_(self.buf)

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
                and last.offset + last.size == p.chunk.start + b
                and last.size + len(part) <= _JOB_BYTES
                and len(last.buffers) < _JOB_BUFFERS
            ):
                last.buffers.append(part)
                last.keys.append(p.key)
                last.size += len(part)
            else:
                jobs.append(_ReadJob(p.chunk.file, p.chunk.start + b, len(part), [part], [p.key]))
    return jobs


def _gather(futures: list[cf.Future[None]], storage: Storage, errors: list[str]) -> None:
    for f in futures:
        e = f.exception()
        if isinstance(e, CorruptCheckpointError):
            errors.append(str(e))
        elif e is not None:
            raise CheckpointError(f"reading the checkpoint at {storage.location} failed: {e}") from e


def plan_pieces(manifest: Manifest, reads: list[Read]) -> list[_Piece]:
    """Every (stored chunk, destination) intersection; raise if some wanted region is not stored."""
    pieces: list[_Piece] = []
    seen: set[tuple[str, int, tuple[int, ...], tuple[int, ...], str, Box]] = set()
    missing = []
    for r in reads:  # tied destinations that share memory are read once
        sig = (r.key, r.dest.data_ptr(), tuple(r.dest.shape), r.dest.stride(), str(r.dest.device), r.region)
        if r.region.numel == 0 or sig in seen:
            continue
        seen.add(sig)
        found = [p for c in manifest.tensors[r.key].chunks if (p := _Piece.make(r.key, c, r)) is not None]
        if sum(p.inter.numel for p in found) != r.region.numel:
            missing.append(f"{r.key!r} {r.region}")
        pieces.extend(found)
    # Destinations that share memory under different keys (a tied model loading an untied
    # checkpoint) must not be read into concurrently: all but the first go through a buffer.
    spans: list[tuple[int, int]] = []
    for p in pieces:
        if p.buf is p.target and p.target.numel():
            lo = p.target.data_ptr()
            hi = lo + p.target.numel() * p.target.element_size()
            if any(a < hi and lo < b for a, b in spans):
                p.bounce()
            else:
                spans.append((lo, hi))
    if missing:
        raise CorruptCheckpointError(
            f"the checkpoint does not hold every part of: {', '.join(missing[:5])}; some rank's shards are missing"
        )
    return pieces


def execute_reads(storage: Storage, manifest: Manifest, reads: list[Read], *, verify: bool) -> None:
    """Read every needed byte range in parallel (large vectored reads for whole chunks), verify
    checksums, and place the data; one error lists every damaged key."""
    pieces = plan_pieces(manifest, reads)
    check_files(storage, manifest, (p.chunk.file for p in pieces))
    whole = [p for p in pieces if p.whole]
    errors: list[str] = []
    with cf.ThreadPoolExecutor(max_workers=_READ_THREADS, thread_name_prefix="stashpoint-reader") as pool:
        futures = [pool.submit(j.run, storage) for j in _read_jobs(whole)]
        futures += [pool.submit(p.read_partial, storage, verify) for p in pieces if not p.whole]
        _gather(futures, storage, errors)
        if not errors and verify:
            _gather([pool.submit(p.verify, storage) for p in pieces], storage, errors)
    if errors:
        raise CorruptCheckpointError("\n".join(errors))
    for p in pieces:
        p.place()


def _wait_for_saves_to(location: str) -> None:
    """Wait for this process's saves in flight to ``location`` (loading it must see the result)."""
    from . import _save

    engine = _save._engine
    if engine is not None:
        cf.wait([h._future for h in list(engine.inflight) if h.path == location])


def load(
    state: Any,
    path: str | os.PathLike[str] | Storage,
    *,
    strict: bool = True,
    verify: bool = True,
    allow_pickle: bool = False,
    process_group: Any = None,
    exchange: bool | None = None,
    timeout: float | None = None,
) -> None:
    """Restore the checkpoint at ``path`` in place into the objects held by ``state``.

    Tensors are read straight into the state's tensors (CPU or CUDA); objects with
    ``load_state_dict`` get their state back; plain values come back whole from the checkpoint.

    Args:
        state: the live state, with the same structure as the saved one.
        path: the checkpoint directory.
        strict: raise :class:`StateMismatchError` listing every missing or unexpected key and
            every shape or dtype difference. With ``strict=False`` what matches is loaded and the
            rest is reported as a warning.
        verify: check every tensor's checksum (:class:`CorruptCheckpointError` on mismatch).
        allow_pickle: unpickle values saved with ``allow_pickle=True``. Unpickling runs code
            from the file: only for files you trust.
        process_group: in a distributed run, the group whose ranks load (default: the world);
            every rank of it calls ``load``. Each rank reads only the byte ranges its tensors
            (or DTensor shards) need, whatever the world size and sharding at save time, and
            gets back the plain values its rank saved (rank ``r`` gets those of rank ``r mod N``
            when N ranks saved).
        exchange: in a distributed run, read regions that every rank needs (replicated tensors)
            from storage once in total — each rank reads a share and broadcasts it on the
            checkpoint group — instead of every rank reading everything it needs directly. The
            default (None) exchanges when the ranks span several hosts: ranks on one host share
            its page cache, so there storage sees each byte about once anyway and direct reads
            are faster (see benchmarks/RESULTS.md).
        timeout: seconds a collective step may wait for the other ranks (default 600).

    A save to ``path`` still in flight in this process (``async_save``) is waited for first.
    """
    from ._save import wait_staged

    wait_staged()  # an overlap=True save still copying these objects must not see loaded values
    storage = storage_for(path)
    _wait_for_saves_to(storage.location)
    manifest = read_manifest(storage)
    extra = unlisted_shards(storage, manifest)
    if extra:
        raise CorruptCheckpointError(
            f"shard {storage.location}/{extra[0]} belongs to this checkpoint's save but its manifest does not list it "
            f"({len(extra)} such file(s)): the manifest is damaged or incomplete. Load an earlier checkpoint."
        )
    rank, world = rank_of(process_group)
    if world != manifest.world_size and len(manifest.trees) > 1:
        log.warning(
            "stashpoint: %s was saved by %d ranks and is loaded by %d; rank %d restores the per-rank values "
            "(RNG states, ...) of saved rank %d",
            storage.location,
            manifest.world_size,
            world,
            rank,
            rank % manifest.world_size,
        )
    ctx = None
    if world > 1:
        from ._save import wait_all

        wait_all()  # the checkpoint group is used by one thread at a time: saves in flight first
        ctx = _dist.context(process_group, timeout)
    share = ctx is not None and (exchange if exchange is not None else ctx.multi_host())
    plan_error: CheckpointError | None = None
    try:
        plan = Planner(manifest, state, allow_pickle=allow_pickle, where=storage.location, rank=rank).run()
        if plan.problems and strict:
            plan_error = StateMismatchError(storage.location, plan.problems)
    except CheckpointError as e:
        plan_error = e
    reads: list[Read] = [] if plan_error else plan.reads
    readers: dict[Item, int] = {}
    if ctx is not None:  # every rank takes the same path: all load, or all raise
        wanted = {(r.key, r.region): r.region.numel * r.dest.element_size() for r in reads} if share else {}
        try:
            statuses = agree(ctx, "load plans", str(plan_error) if plan_error else wanted)
        except CheckpointError:
            if plan_error:
                raise plan_error from None
            raise
        if share:
            readers = assign_readers(statuses)
            reads = [r for r in reads if readers.get((r.key, r.region), ctx.rank) == ctx.rank]
    elif plan_error:
        raise plan_error
    if plan.problems:
        msg = (
            f"stashpoint: loading {storage.location} skipped {len(plan.problems)} mismatch(es):\n  - "
            + "\n  - ".join(plan.problems)
        )
        warnings.warn(msg, stacklevel=2)
        log.warning(msg)
    error: CheckpointError | None = None
    try:
        execute_reads(storage, manifest, reads, verify=verify)
    except CheckpointError as e:
        error = e
    if ctx is not None:
        try:
            agree(ctx, "load reads", str(error) if error else 0, CorruptCheckpointError)
        except CheckpointError:
            if error:
                raise error from None
            raise
        if readers:
            dests: dict[Item, torch.Tensor] = {}
            for r in plan.reads:
                dests.setdefault((r.key, r.region), r.dest)
            with torch.no_grad():
                broadcast_shares(ctx, readers, dests)
                for r in plan.reads:  # a second destination of the same region (rare): copy it over
                    first = dests[(r.key, r.region)]
                    if (r.key, r.region) in readers and r.dest is not first:
                        r.dest.copy_(first)
    elif error:
        raise error
    for s in plan.setters:
        s()
    for fin in plan.finalizers:
        fin()
