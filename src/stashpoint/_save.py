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
from dataclasses import dataclass
from typing import Any

import torch

from ._format import MANIFEST_NAME, Chunk, Manifest, TensorEntry, dtype_name
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


@dataclass(frozen=True)
class SaveStats:
    """Figures of one save. Times are in seconds."""

    path: str
    bytes_written: int
    num_tensors: int
    num_files: int
    blocking_s: float
    staging_s: float
    persist_s: float
    total_s: float

    @property
    def throughput_gbps(self) -> float:
        """Persist throughput in GB/s (10^9 bytes per second)."""
        return self.bytes_written / self.persist_s / 1e9 if self.persist_s > 0 else float("inf")

    def __str__(self) -> str:
        return (
            f"{self.bytes_written / 1e9:.3f} GB to {self.path}: blocked {self.blocking_s * 1e3:.1f} ms "
            f"(staging {self.staging_s * 1e3:.1f} ms), persisted in {self.persist_s:.2f} s "
            f"({self.throughput_gbps:.2f} GB/s)"
        )


class SaveHandle:
    """A save in progress. The state was staged when this handle was returned."""

    def __init__(self, path: str, future: cf.Future[SaveStats], blocking_s: float, staging_s: float) -> None:
        self.path = path
        self._future = future
        self.blocking_s = blocking_s
        self.staging_s = staging_s

    def wait(self, timeout: float | None = None) -> SaveStats:
        """Block until the checkpoint is committed and durable; return its figures.

        Raises :class:`CheckpointError` (with the path and the cause) if the background write
        failed, and :class:`TimeoutError` if ``timeout`` seconds pass first.
        """
        try:
            return self._future.result(timeout)
        except cf.TimeoutError:
            raise TimeoutError(f"the save to {self.path} is still running after {timeout} s") from None

    def done(self) -> bool:
        """True once the save has committed or failed."""
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The background failure, or None if the save succeeded (waits like :meth:`wait`)."""
        try:
            return self._future.exception(timeout)
        except cf.TimeoutError:
            raise TimeoutError(f"the save to {self.path} is still running after {timeout} s") from None

    @property
    def stats(self) -> SaveStats | None:
        """The figures once the save has succeeded, else None."""
        if self._future.done() and self._future.exception() is None:
            return self._future.result()
        return None

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._future.exception() else "committed")
        return f"<SaveHandle {self.path} {state}>"


class _Engine:
    """Per-process state: the writer thread, the staging pool and the plan cache."""

    def __init__(self) -> None:
        self.executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="stashpoint-writer")
        self.pool = StagingPool(max_free=1)
        self.inflight: SaveHandle | None = None
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
    t_start = time.perf_counter()
    engine = _get_engine()
    storage = storage_for(path)
    with engine.lock:
        previous = engine.inflight
        if previous is not None:
            cf.wait([previous._future])
        if storage.exists(MANIFEST_NAME) and not overwrite:
            raise CheckpointError(
                f"a committed checkpoint already exists at {storage.location}; pass overwrite=True to "
                "replace it (it stays loadable until the new one commits) or save to a new path."
            )
        if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("metadata must map str to str; convert the values with str() or json.dumps()")
        tree, tensors = flatten(state, allow_pickle=allow_pickle)
        firsts = group_aliases([_signature(t) for _, t in tensors])
        canonical = [(k, t) for (k, t), a in zip(tensors, firsts) if a is None]
        aliases = {k: tensors[a][0] for (k, _), a in zip(tensors, firsts) if a is not None}
        all_dtypes = {k: t.dtype for k, t in tensors}
        shapes = {k: tuple(t.shape) for k, t in tensors}
        specs = tuple(TensorSpec(k, dtype_name(t.dtype), tuple(t.shape), t.element_size()) for k, t in canonical)
        plan = engine.plan(specs, max_shard_bytes)
        pinned = torch.cuda.is_available() and any(t.device.type == "cuda" for _, t in canonical)
        staged = engine.pool.acquire(plan, specs, pinned)
        t_stage = time.perf_counter()
        try:
            stage([(t, staged.views[k]) for k, t in canonical])
        except BaseException:
            engine.pool.release(staged)
            raise
        staging_s = time.perf_counter() - t_stage
        job = _PersistJob(
            storage, staged, engine.pool, tree, all_dtypes, shapes, aliases, dict(metadata or {}), overwrite
        )
        future = engine.executor.submit(job.run, t_start, staging_s)
        blocking_s = time.perf_counter() - t_start
        job.blocking_s = blocking_s
        handle = SaveHandle(storage.location, future, blocking_s, staging_s)
        engine.inflight = handle
    return handle


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
    metadata: dict[str, str]
    overwrite: bool
    blocking_s: float = 0.0

    def run(self, t_start: float, staging_s: float) -> SaveStats:
        t0 = time.perf_counter()
        loc = self.storage.location
        save_id = uuid.uuid4().hex[:16]
        try:
            self.storage.prepare()
            written = write_shards(self.storage, self.staged, save_id, self.dtypes, self.shapes)
            self.storage.sync()
            manifest = self._manifest(save_id, written.files, written.chunks)
            self.storage.commit(MANIFEST_NAME, manifest.to_json())
            if self.overwrite:
                self._remove_stale(manifest)
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
            bytes_written=written.bytes_written + len(manifest.to_json()),
            num_tensors=len(self.dtypes),
            num_files=len(written.files),
            blocking_s=self.blocking_s,
            staging_s=staging_s,
            persist_s=t1 - t0,
            total_s=t1 - t_start,
        )
        log.info("stashpoint: saved %s", stats)
        return stats

    def _manifest(self, save_id: str, files: Any, chunks: Mapping[str, tuple[str, int, int, str]]) -> Manifest:
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
            tree=self.tree,
            metadata=self.metadata,
        )

    def _remove_own_files(self, save_id: str) -> None:
        try:
            for name in self.storage.list():
                if _SHARD_RE.match(name) and save_id in name:
                    self.storage.delete(name)
        except OSError as e:  # best effort: the save already failed for a reason of its own
            log.warning("stashpoint: could not remove partial files of %s: %s", self.storage.location, e)

    def _remove_stale(self, manifest: Manifest) -> None:
        keep = {f.name for f in manifest.files}
        for name in self.storage.list():
            if _SHARD_RE.match(name) and name not in keep:
                self.storage.delete(name)


def wait_all() -> None:
    """Wait for the save in flight in this process, if any (failures are not raised here)."""
    engine = _engine
    if engine is not None and engine.inflight is not None:
        cf.wait([engine.inflight._future])
