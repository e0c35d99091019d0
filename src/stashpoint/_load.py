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

from ._format import MANIFEST_NAME, Chunk, FileEntry, Manifest, parse_header, parse_manifest
from ._persist import checksum
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
        raw = storage.read(MANIFEST_NAME)
    except FileNotFoundError:
        if storage.exists(None):
            raise IncompleteCheckpointError(
                f"{loc} exists but holds no committed checkpoint (no {MANIFEST_NAME}): the save that "
                "wrote it did not finish. Load an earlier checkpoint, or delete this directory."
            ) from None
        raise CheckpointNotFoundError(f"no checkpoint at {loc}: the path does not exist") from None
    return parse_manifest(raw, f"{loc}/{MANIFEST_NAME}")


def check_files(storage: Storage, manifest: Manifest, names: Iterable[str]) -> None:
    """Check that each shard exists with its recorded size and an intact header of this save."""
    files = {f.name: f for f in manifest.files}
    for name in sorted(set(names)):
        fe: FileEntry = files[name]
        where = f"{storage.location}/{name}"
        try:
            size = storage.size(name)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"shard {where} listed in the manifest is missing") from None
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


def _chunk_view(dest: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    view = dest
    for dim, (off, n) in enumerate(zip(chunk.offsets, chunk.shape)):
        if off != 0 or n != dest.shape[dim]:
            view = view.narrow(dim, off, n)
    return view


_JOB_BYTES = 64 * 1024 * 1024
_JOB_BUFFERS = 256


@dataclass
class _ChunkRead:
    """One chunk on its way into its destination: read, then verified and placed."""

    key: str
    chunk: Chunk
    target: torch.Tensor  # the destination region
    buf: torch.Tensor  # where the bytes land: the target itself, or a bounce buffer

    @classmethod
    def make(cls, key: str, chunk: Chunk, dest: torch.Tensor) -> _ChunkRead:
        target = _chunk_view(dest, chunk)
        direct = target.device.type == "cpu" and target.is_contiguous()
        return cls(key, chunk, target, target if direct else torch.empty(chunk.shape, dtype=dest.dtype))

    def finish(self, storage: Storage, verify: bool) -> None:
        if verify and checksum(as_memoryview(self.buf)) != self.chunk.checksum:
            raise CorruptCheckpointError(
                f"checksum mismatch for key {self.key!r} in shard {storage.location}/{self.chunk.file}: the "
                "data is damaged. Load an earlier checkpoint or a copy of this one."
            )
        if self.buf is not self.target:
            self.target.copy_(self.buf)


@dataclass
class _ReadJob:
    """One vectored read: a contiguous byte range of a file into a list of buffers."""

    file: str
    offset: int
    buffers: list[memoryview]
    keys: list[str]

    @property
    def end(self) -> int:
        return self.offset + sum(len(b) for b in self.buffers)

    def run(self, storage: Storage) -> None:
        try:
            storage.readv(self.file, self.offset, self.buffers)
        except EOFError as e:
            keys = ", ".join(repr(k) for k in sorted(set(self.keys))[:5])
            raise CorruptCheckpointError(
                f"shard {storage.location}/{self.file} is truncated inside {keys}: {e}"
            ) from None


def _read_jobs(reads: list[_ChunkRead]) -> list[_ReadJob]:
    """Coalesce reads of adjacent byte ranges into large vectored reads (the layout is gap-free)."""
    jobs: list[_ReadJob] = []
    for r in sorted(reads, key=lambda r: (r.chunk.file, r.chunk.start)):
        mv = as_memoryview(r.buf)
        for b in range(0, len(mv), _JOB_BYTES):
            piece = mv[b : b + _JOB_BYTES]
            last = jobs[-1] if jobs else None
            if (
                last is not None
                and last.file == r.chunk.file
                and last.end == r.chunk.start + b
                and last.end - last.offset + len(piece) <= _JOB_BYTES
                and len(last.buffers) < _JOB_BUFFERS
            ):
                last.buffers.append(piece)
                last.keys.append(r.key)
            else:
                jobs.append(_ReadJob(r.chunk.file, r.chunk.start + b, [piece], [r.key]))
    return jobs


def _gather(futures: list[cf.Future[None]], storage: Storage, errors: list[str]) -> None:
    for f in futures:
        e = f.exception()
        if isinstance(e, CorruptCheckpointError):
            errors.append(str(e))
        elif e is not None:
            raise CheckpointError(f"reading the checkpoint at {storage.location} failed: {e}") from e


def execute_reads(storage: Storage, manifest: Manifest, reads: list[Read], *, verify: bool) -> None:
    """Run every read as large parallel vectored reads, then verify; one error lists every damaged key."""
    unique: list[Read] = []
    seen: set[tuple[str, int, tuple[int, ...], tuple[int, ...], str]] = set()
    for r in reads:  # tied destinations that share memory are read once
        sig = (r.key, r.dest.data_ptr(), tuple(r.dest.shape), r.dest.stride(), str(r.dest.device))
        if r.dest.numel() == 0 or sig in seen:
            continue
        seen.add(sig)
        unique.append(r)
    chunks = [_ChunkRead.make(r.key, c, r.dest) for r in unique for c in manifest.tensors[r.key].chunks]
    check_files(storage, manifest, (c.chunk.file for c in chunks))
    errors: list[str] = []
    with cf.ThreadPoolExecutor(max_workers=_READ_THREADS, thread_name_prefix="stashpoint-reader") as pool:
        _gather([pool.submit(j.run, storage) for j in _read_jobs(chunks)], storage, errors)
        if not errors:
            _gather([pool.submit(c.finish, storage, verify) for c in chunks], storage, errors)
    if errors:
        raise CorruptCheckpointError("\n".join(errors))


def load(
    state: Any,
    path: str | os.PathLike[str] | Storage,
    *,
    strict: bool = True,
    verify: bool = True,
    allow_pickle: bool = False,
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
    """
    storage = storage_for(path)
    manifest = read_manifest(storage)
    plan = Planner(manifest, state, allow_pickle=allow_pickle, where=storage.location).run()
    if plan.problems:
        if strict:
            raise StateMismatchError(storage.location, plan.problems)
        msg = (
            f"stashpoint: loading {storage.location} skipped {len(plan.problems)} mismatch(es):\n  - "
            + "\n  - ".join(plan.problems)
        )
        warnings.warn(msg, stacklevel=2)
        log.warning(msg)
    execute_reads(storage, manifest, plan.reads, verify=verify)
    for s in plan.setters:
        s()
    for fin in plan.finalizers:
        fin()
