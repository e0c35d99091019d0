"""CheckpointManager: a run directory of steps, with retention, bounded saves and crash recovery."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from ._dist import rank_of
from ._format import MANIFEST_NAME
from ._handle import SaveHandle, SaveStats
from ._load import load, read_manifest
from ._policy import Retention, Schedule, parse_step_dir, step_dir, steps_to_keep
from ._save import SaveOptions, _get_engine
from ._storage import LocalStorage, Storage, storage_for
from .errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError

log = logging.getLogger("stashpoint")

LOCK_NAME = ".stashpoint-manager.lock"
_METRICS_KEY = "stashpoint.metrics"


class CheckpointManager:
    """Saves a training state every so often into ``root/step-XXXXXXXX`` and keeps the right ones.

    Typical use::

        with stashpoint.CheckpointManager("runs/exp1", keep_last=3, every_steps=500) as mgr:
            start = (mgr.restore(state) or 0) + 1          # None on a fresh run
            for step in range(start, total + 1):
                train_one_step()
                mgr.maybe_save(step, state, metrics={"loss": loss})

    Args:
        root: the run directory (created if needed).
        keep_last: keep the newest N committed steps (None: no limit from this rule).
        keep_every: also keep every step that is a multiple of K, forever.
        keep_best: also keep the K best steps by a metric: ``(K, "metric")`` (lowest is best) or
            ``(K, "metric", "max")``. Pass the metric in ``save(..., metrics=...)``.
        max_inflight: saves that may be staged or persisting at once. Each holds one staged copy
            of the state in host memory, so this bounds the host memory used for staging.
        on_busy: when ``max_inflight`` saves are in flight, ``"wait"`` blocks until one commits
            (backpressure) and ``"skip"`` skips the new save (logged and counted).
        every_steps, every_seconds: when :meth:`maybe_save` saves.
        on_save: called with the :class:`SaveStats` of every save once it commits or is skipped.

    Only one manager may own a root at a time; a second one is refused with an error. On
    opening, directories of saves that never committed (a crash) are removed.

    In a distributed run every rank creates a manager on the same root and calls ``save`` /
    ``maybe_save`` / ``restore`` at the same steps (saves are collective); rank 0 owns the root
    (lock, cleanup, retention). Save options such as ``process_group`` and ``timeout`` pass
    through ``save(..., **options)``.
    """

    #: The backend of each step under a local root (tests inject faults by subclassing it).
    storage_class: type[LocalStorage] = LocalStorage

    def __init__(
        self,
        root: str | os.PathLike[str] | Storage,
        *,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        keep_best: tuple[int, str] | tuple[int, str, str] | None = None,
        max_inflight: int = 1,
        on_busy: str = "wait",
        every_steps: int | None = None,
        every_seconds: float | None = None,
        on_save: Callable[[SaveStats], None] | None = None,
    ) -> None:
        best_k, metric, mode = _parse_keep_best(keep_best)
        self.retention = Retention(keep_last, keep_every, best_k, metric, mode)
        self.schedule = Schedule(every_steps, every_seconds)
        SaveOptions(max_inflight=max_inflight, on_busy=on_busy)  # validates
        self.storage = storage_for(root)
        self.root: Path | str = self.storage.root if isinstance(self.storage, LocalStorage) else self.storage.location
        self.max_inflight = max_inflight
        self.on_busy = on_busy
        self.on_save = on_save
        self.history: collections.deque[SaveStats] = collections.deque(maxlen=1000)
        self.skipped = 0
        self._handles: list[tuple[SaveHandle, cf.Future[None]]] = []
        self._metrics: dict[int, dict[str, float]] = {}
        self._last_save_time: float | None = None
        self._lock = threading.Lock()
        self._deleter = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="stashpoint-retention")
        self._deletions: list[cf.Future[None]] = []
        self._closed = False
        self.rank, self.world = rank_of()
        self.storage.prepare()
        # In a distributed run rank 0 owns the root: the lock, the cleanup and the retention.
        # (Object stores offer no lock: there, one manager per root is the user's to ensure.)
        self._lock_fd = -1
        if self.rank == 0 and isinstance(self.storage, LocalStorage):
            self._lock_fd = _acquire_root_lock(self.storage.root)
        if self.rank == 0:
            _remove_leftovers(self.storage)

    # -- listing -------------------------------------------------------------------------------

    def path(self, step: int) -> Path | str:
        """Where ``step`` lives: a directory under a local root, a URL under a remote one."""
        target = self._at(step)
        return target.root if isinstance(target, LocalStorage) else target.location

    def _at(self, step: int) -> Storage:
        if isinstance(self.storage, LocalStorage):
            return self.storage_class(self.storage.root / step_dir(step))
        return self.storage.child(step_dir(step))

    def steps(self) -> list[int]:
        """Committed steps, oldest first. Saves in progress and crashed saves are not listed."""
        return committed_steps(self.storage)

    def latest_step(self) -> int | None:
        """The newest committed step, or None when the root holds none."""
        steps = self.steps()
        return steps[-1] if steps else None

    # -- saving --------------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether a save is due at ``step`` by ``every_steps`` / ``every_seconds``."""
        if not self.schedule.configured:
            raise ValueError("should_save needs every_steps and/or every_seconds on the CheckpointManager")
        if self.world > 1 and self.schedule.every_seconds is not None:
            raise ValueError(
                "every_seconds would let ranks decide differently in a distributed run (their clocks differ); "
                "use every_steps, or decide on rank 0 and broadcast the decision on your own group"
            )
        return self.schedule.due(step, time.monotonic(), self._last_save_time)

    def maybe_save(
        self, step: int, state: Any, *, metrics: Mapping[str, float] | None = None, **options: Any
    ) -> SaveHandle | None:
        """Save if :meth:`should_save` says so; return the handle, or None when no save was due."""
        return self.save(step, state, metrics=metrics, **options) if self.should_save(step) else None

    def save(self, step: int, state: Any, *, metrics: Mapping[str, float] | None = None, **options: Any) -> SaveHandle:
        """Start an asynchronous save of ``state`` as ``step``; returns once the state is staged.

        ``options`` are those of :func:`stashpoint.async_save` (``allow_pickle``, ``metadata``,
        ``max_shard_bytes``). Older steps are deleted by the retention rules in the background
        once this one has committed.
        """
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        target = self._at(step)
        with self._lock:
            if any(h.step == step and not a.done() for h, a in self._handles):
                raise CheckpointError(
                    f"step {step} is still being saved to {target.location}; wait for that save (mgr.wait()) first"
                )
        if target.exists(MANIFEST_NAME):
            raise CheckpointError(
                f"step {step} already has a committed checkpoint at {target.location}; save under a new step, or "
                "delete that directory first."
            )
        if self.rank == 0:  # the remains of an earlier failed save of this step, if any
            target.remove_tree()
        metrics = dict(metrics or {})
        meta = dict(options.pop("metadata", None) or {})
        meta[_METRICS_KEY] = json.dumps(metrics)
        if "timeout" in options:
            options["timeout_s"] = options.pop("timeout")
        opts = SaveOptions(metadata=meta, max_inflight=self.max_inflight, on_busy=self.on_busy, step=step, **options)
        self._last_save_time = time.monotonic()
        handle = _get_engine().submit(state, target, opts)
        after: cf.Future[None] = cf.Future()  # done once the bookkeeping below has run too
        with self._lock:
            # keep saves in flight, and failed ones until wait() has reported them
            self._handles = [(h, a) for h, a in self._handles if not a.done() or h.exception() is not None]
            self._handles.append((handle, after))
        handle._future.add_done_callback(lambda f: self._after_save(step, metrics, f, after))
        return handle

    def _after_save(
        self, step: int, metrics: dict[str, float], future: cf.Future[SaveStats], after: cf.Future[None]
    ) -> None:
        try:
            if future.exception() is not None:
                if self.rank == 0 and not self._at(step).exists(MANIFEST_NAME):
                    _quietly(self._at(step).remove_tree)
                return
            stats = future.result()
            with self._lock:
                self.history.append(stats)
                if stats.skipped:
                    self.skipped += 1
                else:
                    self._metrics[step] = metrics
                    if self.rank == 0:
                        self._deletions.append(self._deleter.submit(self._apply_retention))
            if self.on_save is not None:
                try:
                    self.on_save(stats)
                except Exception:
                    log.exception("stashpoint: the on_save callback raised")
        finally:
            after.set_result(None)

    # -- retention -----------------------------------------------------------------------------

    def _metrics_of(self, step: int) -> dict[str, float]:
        if step not in self._metrics:
            self._metrics[step] = read_metrics(self._at(step))
        return self._metrics[step]

    def _apply_retention(self) -> None:
        steps = self.steps()
        keep = steps_to_keep(steps, {s: self._metrics_of(s) for s in steps}, self.retention)
        for step in steps:
            if step not in keep:
                delete_step(self.storage, step)
                self._metrics.pop(step, None)

    # -- restoring -----------------------------------------------------------------------------

    def restore(self, state: Any, step: int | None = None, *, strict: bool = True, **options: Any) -> int | None:
        """Load ``step`` (default: the newest committed one) into ``state``; return the step.

        Returns None when the root holds no committed checkpoint, so resuming is one line. When
        no step is given and the newest checkpoint turns out damaged, the error is logged, the
        next older one is tried, and the damaged steps are moved aside (renamed
        ``step-XXXXXXXX.damaged-<time>``, kept for inspection, never listed again) so that
        training can save those steps anew. ``options`` are those of :func:`stashpoint.load`
        (``verify``, ``allow_pickle``, ``exchange``, ``timeout``, ``process_group``).
        """
        if step is not None:
            load(state, self._at(step), strict=strict, **options)
            return step
        damaged: list[int] = []
        errors: list[CheckpointError] = []
        for candidate in reversed(self.steps()):
            try:
                load(state, self._at(candidate), strict=strict, **options)
            except (CorruptCheckpointError, IncompleteCheckpointError) as e:
                log.error("stashpoint: step %d is unusable (%s); trying an older one", candidate, e)
                errors.append(e)
                damaged.append(candidate)
                continue
            self._move_aside(damaged)
            return candidate
        if errors:
            raise errors[0]
        return None

    def _move_aside(self, steps: list[int]) -> None:
        if self.rank == 0:
            for s in steps:
                move_aside(self.storage, s)

    # -- lifecycle -----------------------------------------------------------------------------

    def wait(self) -> None:
        """Wait for this manager's saves and deletions; raise the first save failure, if any."""
        with self._lock:
            pairs, self._handles = self._handles, []
        cf.wait([a for _, a in pairs])
        handles = [h for h, _ in pairs]
        while True:
            with self._lock:
                pending, self._deletions = self._deletions, []
            if not pending:
                break
            cf.wait(pending)
        for h in handles:
            exc = h.exception()
            if exc is not None:
                raise exc

    def close(self) -> None:
        """Wait for pending saves and deletions, then release the root."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._deleter.shutdown(wait=True)
            if self._lock_fd >= 0:
                os.close(self._lock_fd)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"this CheckpointManager on {self.root} is closed; create a new one")

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if et is None:
            self.close()
            return
        try:  # do not hide the exception already on its way out
            self.close()
        except CheckpointError as e:
            log.error("stashpoint: while closing the manager: %s", e)

    def __repr__(self) -> str:
        return f"<CheckpointManager {self.root} steps={self.steps()}>"


def committed_steps(root: Storage) -> list[int]:
    """The committed steps under a run root, oldest first."""
    found = []
    for name in root.children():
        step = parse_step_dir(name)
        if step is not None and root.child(name).exists(MANIFEST_NAME):
            found.append(step)
    return sorted(found)


def read_metrics(step: Storage) -> dict[str, float]:
    """The metrics a step was saved with ({} when unreadable)."""
    try:
        value = json.loads(read_manifest(step).metadata.get(_METRICS_KEY, "{}"))
    except (CheckpointError, OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def delete_step(root: Storage, step: int) -> None:
    """Uncommit first (the manifest goes), then remove the rest: a crash leaves a leftover."""
    target = root.child(step_dir(step))
    try:
        target.delete(MANIFEST_NAME)
        target.sync()
        target.remove_tree()
        log.info("stashpoint: removed step %d from %s (retention)", step, root.location)
    except OSError as e:
        log.warning("stashpoint: could not remove %s: %s", target.location, e)


def _remove_leftovers(root: Storage) -> None:
    for name in root.children():
        step = parse_step_dir(name)
        target = root.child(name)
        if step is not None and not target.exists(MANIFEST_NAME):
            log.warning("stashpoint: removing %s, left by a save that never committed", target.location)
            _quietly(target.remove_tree)


def move_aside(root: Storage, step: int) -> None:
    """Rename a damaged step ``step-XXXXXXXX.damaged-<time>``: kept for inspection, never listed."""
    name = f"{step_dir(step)}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        moved = root.child(step_dir(step)).move(name)
        log.warning("stashpoint: moved the damaged step %d aside to %s", step, moved.location)
    except OSError as e:
        log.warning("stashpoint: could not move the damaged step %d aside: %s", step, e)


def _quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except OSError as e:
        log.warning("stashpoint: cleanup failed: %s", e)


def _parse_keep_best(value: Any) -> tuple[int | None, str, str]:
    if value is None:
        return None, "loss", "min"
    if isinstance(value, tuple) and len(value) in (2, 3) and isinstance(value[0], int) and isinstance(value[1], str):
        return value[0], value[1], value[2] if len(value) == 3 else "min"
    raise ValueError(f"keep_best must be (k, 'metric') or (k, 'metric', 'min'|'max'), got {value!r}")


def _acquire_root_lock(root: Path) -> int:
    fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CheckpointError(
            f"another CheckpointManager (in this or another process) already owns {root}; close it first, "
            "or give each run its own directory."
        ) from None
    return fd
