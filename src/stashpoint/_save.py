"""save / async_save: stage into reused host buffers (blocking), persist in the background."""

from __future__ import annotations

import concurrent.futures as cf
import datetime as _dt
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ._format import MANIFEST_NAME, Chunk, Manifest, TensorEntry, dtype_name
from ._handle import SaveHandle, SaveStats
from ._persist import write_shards
from ._plan import SavePlan, TensorSpec, group_aliases, plan_files
from ._staging import StagingBuffers, StagingPool, stage
from ._storage import Storage, storage_for
from ._tree import flatten
from ._version import __version__
from .errors import CheckpointError

log = logging.getLogger("stashpoint")

DEFAULT_MAX_SHARD_BYTES = 1 << 30
_SHARD_RE = re.compile(r"^shard-r\d+-\d+-[0-9a-f]+\.safetensors$")


class _Engine:
    """Per-process state: the writer thread, the staging pool, the plan cache, saves in flight."""

    def __init__(self) -> None:
        self.executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="stashpoint-writer")
        self.pool = StagingPool(max_free=1)
        self.inflight: list[SaveHandle] = []
        self.lock = threading.Lock()
        self._plans: dict[tuple[Any, ...], SavePlan] = {}

    def plan(self, specs: tuple[TensorSpec, ...], max_file_bytes: int) -> SavePlan:
        key = (specs, max_file_bytes)
        plan = self._plans.get(key)
        if plan is None:
            plan = plan_files(specs, max_file_bytes=max_file_bytes)
            if len(self._plans) >= 16:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = plan
        return plan

    def make_room(self, max_inflight: int, on_busy: str) -> bool:
        """Wait until fewer than ``max_inflight`` saves are in flight; False to skip instead."""
        while True:
            self.inflight = [h for h in self.inflight if not h.done()]
            if len(self.inflight) < max_inflight:
                return True
            if on_busy == "skip":
                return False
            cf.wait([h._future for h in self.inflight], return_when=cf.FIRST_COMPLETED)

    def submit(self, state: Any, storage: Storage, opts: SaveOptions) -> SaveHandle:
        """Stage ``state`` (blocking) and queue its persist; see :func:`async_save`."""
        t_start = time.perf_counter()
        with self.lock:
            if not self.make_room(opts.max_inflight, opts.on_busy):
                log.warning(
                    "stashpoint: skipped the save to %s: the previous save is still persisting", storage.location
                )
                return SaveHandle.skipped(storage.location, opts.step, time.perf_counter() - t_start)
            if storage.exists(MANIFEST_NAME) and not opts.overwrite:
                raise CheckpointError(
                    f"a committed checkpoint already exists at {storage.location}; pass overwrite=True to "
                    "replace it (it stays loadable until the new one commits) or save to a new path."
                )
            tree, tensors = flatten(state, allow_pickle=opts.allow_pickle)
            firsts = group_aliases([_signature(t) for _, t in tensors])
            canonical = [(k, t) for (k, t), a in zip(tensors, firsts) if a is None]
            aliases = {k: tensors[a][0] for (k, _), a in zip(tensors, firsts) if a is not None}
            specs = tuple(TensorSpec(k, dtype_name(t.dtype), tuple(t.shape), t.element_size()) for k, t in canonical)
            plan = self.plan(specs, opts.max_shard_bytes)
            pinned = torch.cuda.is_available() and any(t.device.type == "cuda" for _, t in canonical)
            self.pool.max_free = max(self.pool.max_free, opts.max_inflight)
            staged = self.pool.acquire(plan, specs, pinned)
            t_stage = time.perf_counter()
            try:
                stage([(t, staged.views[k]) for k, t in canonical])
            except BaseException:
                self.pool.release(staged)
                raise
            staging_s = time.perf_counter() - t_stage
            job = _PersistJob(
                storage,
                staged,
                self.pool,
                tree,
                {k: t.dtype for k, t in tensors},
                {k: tuple(t.shape) for k, t in tensors},
                aliases,
                opts,
            )
            job.blocking_s = time.perf_counter() - t_start
            future = self.executor.submit(job.run, t_start, staging_s)
            handle = SaveHandle(storage.location, future, job.blocking_s, staging_s)
            self.inflight.append(handle)
        return handle


_engine: _Engine | None = None
_engine_lock = threading.Lock()


def _get_engine() -> _Engine:
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = _Engine()
        return _engine


def _signature(t: torch.Tensor) -> tuple[Any, ...] | None:
    if t.numel() == 0:
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)


@dataclass(frozen=True)
class SaveOptions:
    """Options of one save (the public ones are documented on :func:`async_save`)."""

    overwrite: bool = False
    allow_pickle: bool = False
    metadata: Mapping[str, str] = field(default_factory=dict)
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    max_inflight: int = 1
    on_busy: str = "wait"
    step: int | None = None

    def __post_init__(self) -> None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.metadata.items()):
            raise TypeError("metadata must map str to str; convert the values with str() or json.dumps()")
        if self.on_busy not in ("wait", "skip"):
            raise ValueError(f"on_busy must be 'wait' or 'skip', got {self.on_busy!r}")
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight must be at least 1, got {self.max_inflight}")
        if self.max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be positive, got {self.max_shard_bytes}")


def async_save(
    state: Any,
    path: str | os.PathLike[str] | Storage,
    *,
    overwrite: bool = False,
    allow_pickle: bool = False,
    metadata: Mapping[str, str] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> SaveHandle:
    """Stage ``state`` into host buffers and return; write, checksum, fsync and commit in the background.

    Training may change the state as soon as this returns. A save still in flight in this
    process is waited for first (one staged copy of the state at a time).

    Args:
        state: a dict (or list/tuple) of tensors, plain values and objects with
            ``state_dict()``/``load_state_dict()`` (modules, optimizers, schedulers, ...).
        path: the checkpoint directory to create.
        overwrite: replace a committed checkpoint at ``path``. The old one stays loadable until
            the new one commits.
        allow_pickle: pickle values that are not otherwise supported (loading them then needs
            ``allow_pickle=True`` too).
        metadata: string key/values stored in the manifest.
        max_shard_bytes: the largest data section of one shard file.

    Returns:
        a :class:`SaveHandle`; ``wait()`` returns :class:`SaveStats` or raises the failure.
    """
    opts = SaveOptions(overwrite, allow_pickle, dict(metadata or {}), max_shard_bytes)
    return _get_engine().submit(state, storage_for(path), opts)


def save(state: Any, path: str | os.PathLike[str] | Storage, **options: Any) -> SaveStats:
    """Save ``state`` to ``path`` and return once the checkpoint is committed and durable.

    Takes the same options as :func:`async_save`.
    """
    return async_save(state, path, **options).wait()


@dataclass
class _PersistJob:
    storage: Storage
    staged: StagingBuffers
    pool: StagingPool
    tree: dict[str, Any]
    dtypes: dict[str, torch.dtype]
    shapes: dict[str, tuple[int, ...]]
    aliases: dict[str, str]
    opts: SaveOptions
    blocking_s: float = 0.0

    def run(self, t_start: float, staging_s: float) -> SaveStats:
        t0 = time.perf_counter()
        loc = self.storage.location
        save_id = uuid.uuid4().hex[:16]
        try:
            self.storage.prepare()
            written = write_shards(self.storage, self.staged, save_id, self.dtypes, self.shapes)
            self.storage.sync()
            manifest_bytes = self._manifest(save_id, written.files, written.chunks).to_json()
            self.storage.commit(MANIFEST_NAME, manifest_bytes)
            if self.opts.overwrite:
                self._remove_stale({f.name for f in written.files})
        except BaseException as e:
            log.error("stashpoint: saving %s failed: %s", loc, e)
            self._remove_own_files(save_id)
            raise CheckpointError(
                f"saving the checkpoint to {loc} failed: {type(e).__name__}: {e}. Nothing was committed "
                "there and earlier checkpoints are untouched; fix the cause and save again."
            ) from e
        finally:
            self.pool.release(self.staged)
        t1 = time.perf_counter()
        stats = SaveStats(
            path=loc,
            bytes_written=written.bytes_written + len(manifest_bytes),
            num_tensors=len(self.dtypes),
            num_files=len(written.files),
            blocking_s=self.blocking_s,
            staging_s=staging_s,
            persist_s=t1 - t0,
            total_s=t1 - t_start,
            step=self.opts.step,
        )
        log.info("stashpoint: saved %s", stats)
        return stats

    def _manifest(
        self, save_id: str, files: Any, chunks: Mapping[str, tuple[str, int, int, tuple[str, ...]]]
    ) -> Manifest:
        tensors: dict[str, TensorEntry] = {}
        for key, dtype in self.dtypes.items():
            shape = self.shapes[key]
            if key in self.aliases:
                tensors[key] = TensorEntry(key, dtype_name(dtype), shape, (), self.aliases[key])
            else:
                fname, start, end, digest = chunks[key]
                chunk = Chunk(fname, (0,) * len(shape), shape, start, end, digest)
                tensors[key] = TensorEntry(key, dtype_name(dtype), shape, (chunk,))
        return Manifest(
            save_id=save_id,
            created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            library_version=__version__,
            torch_version=torch.__version__,
            files=tuple(files),
            tensors=tensors,
            trees=(self.tree,),
            metadata=self.opts.metadata,
        )

    def _remove_own_files(self, save_id: str) -> None:
        try:
            for name in self.storage.list():
                if _SHARD_RE.match(name) and save_id in name:
                    self.storage.delete(name)
        except OSError as e:  # best effort: the save already failed for a reason of its own
            log.warning("stashpoint: could not remove partial files of %s: %s", self.storage.location, e)

    def _remove_stale(self, keep: set[str]) -> None:
        for name in self.storage.list():
            if _SHARD_RE.match(name) and name not in keep:
                self.storage.delete(name)


def wait_all() -> None:
    """Wait for the save in flight in this process, if any (failures are not raised here)."""
    engine = _engine
    if engine is not None:
        cf.wait([h._future for h in list(engine.inflight)])
