"""save / async_save: stage into reused host buffers (blocking), persist in the background."""

from __future__ import annotations

import concurrent.futures as cf
import difflib
import inspect
import logging
import os
import time
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from stashpoint import _runtime
from stashpoint._core.naming import LOCK_NAME, MANIFEST_NAME, parse_step_dir
from stashpoint._core.plan import SavePlan, TensorSpec, plan_files
from stashpoint._core.policy import usable_seconds
from stashpoint._dist import group as _dist
from stashpoint._dist.group import DistContext
from stashpoint._runtime import gc_paused
from stashpoint._save import overlap as _overlap
from stashpoint._save import teardown
from stashpoint._save import writerproc as _writerproc
from stashpoint._save.calllock import CallLock
from stashpoint._save.cudacopy import cuda_device, refuse_capture, stage
from stashpoint._save.handle import SaveHandle, SaveStats
from stashpoint._save.job import PersistJob
from stashpoint._save.layout import LayoutCache
from stashpoint._save.options import DEFAULT_MAX_SHARD_BYTES, DEFAULT_WRITER, SaveOptions, copy_metadata
from stashpoint._save.staging import StagingPool, reserved
from stashpoint._state.tree import flatten_with_buffers
from stashpoint._storage import LocalStorage, Storage, path_problem, same_place, storage_for
from stashpoint.errors import CheckpointError

log = logging.getLogger("stashpoint")
SAY_AFTER_S = 30.0  # a shutdown waiting longer for saves says so


class _Engine:
    """Per-process state: the writer thread, the staging pool, the plan cache, saves in flight."""

    def __init__(self) -> None:
        self.executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="stashpoint-writer")
        # overlap mode's background copies: never queued behind a persist, never on the writer thread
        self.copier = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="stashpoint-copy")
        self.pool = StagingPool(max_free=1)
        self.pool.on_drop = _writerproc.forget_freed  # dropped buffers: the writer process unmaps them
        self.inflight: list[SaveHandle] = []
        self.lock = CallLock()
        self._plans: dict[tuple[Any, ...], SavePlan] = {}
        self.layouts = LayoutCache()
        # one process saving alone: one context, as a group's, so that a save of the same
        # structure reuses the last plan (its catalog) instead of making it again
        self.solo = DistContext.solo()

    def close(self) -> None:
        """Wait for the saves in flight (their errors stay with their handles), then stop the threads."""
        inflight = [h for h in list(self.inflight) if not h.done()]
        if cf.wait([h._future for h in inflight], timeout=SAY_AFTER_S).not_done:  # a program that seems to hang at exit
            left = [h.path for h in inflight if not h.done()]
            log.warning(
                "stashpoint: shutting down (the program is ending, or stashpoint.shutdown()) waits for %d save(s) "
                "still being written: %s",
                len(left),
                ", ".join(left[:3]) + (", ..." if len(left) > 3 else ""),
            )
        cf.wait([h._future for h in inflight])
        _overlap.wait_pending()
        self.copier.shutdown(wait=True)
        self.executor.shutdown(wait=True)

    def plan(self, specs: tuple[TensorSpec, ...], max_file_bytes: int, rank: int) -> SavePlan:
        """The staging layout of ``specs``: laid out as their shard files will be, so that each
        file is one contiguous run of staging memory."""
        key = (specs, max_file_bytes, rank)
        plan = self._plans.get(key)
        if plan is None:
            plan = plan_files(specs, max_file_bytes=max_file_bytes, rank=rank)
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
        """Stage ``state`` (blocking) and queue its persist; see :func:`async_save`.

        In a distributed save a failure here on one rank (a refused value, an existing
        checkpoint, no memory) still queues the save's collectives with the error, so that every
        rank fails this save together instead of pairing their next saves out of step.
        """
        t_start = time.perf_counter()
        # refused before any group is made: a rank that raised here must not leave its peers
        # half-way through creating stashpoint's gloo group with it
        if opts.on_busy == "skip" and _distributed(opts.process_group):
            raise ValueError(
                "on_busy='skip' would let ranks skip different saves in a distributed run; use on_busy='wait'"
            )
        ctx = _dist.context(opts.process_group, opts.timeout_s) or self.solo
        if ctx.world > 1:
            teardown.install(_pending_saves)
        if ctx.world == 1 and opts.process_group is None and unjoined_launch():
            warnings.warn(  # each process would save alone, and they would race for one path
                f"WORLD_SIZE={os.environ['WORLD_SIZE']} but torch.distributed is not initialized: this process saves "
                f"{storage.location} alone. Call torch.distributed.init_process_group() before saving (and keep "
                "it until the saves are done), or save from one process only",
                stacklevel=4,
            )
        with self.lock:
            _overlap.wait_pending()  # the previous save's copies first: one set of copies at a time
            if not self.make_room(opts.max_inflight, opts.on_busy):
                log.warning(
                    "stashpoint: skipped the save to %s: the previous save is still persisting", storage.location
                )
                return SaveHandle.skipped(storage.location, opts.step, time.perf_counter() - t_start)
            ctx.saves += 1
            # A state of many tensors makes tens of thousands of small records here; the garbage
            # collections they would set off walk every object of the process, inside the call.
            with gc_paused():
                try:
                    job, staging_s = self._stage(state, storage, opts, ctx)
                except BaseException as e:
                    if ctx.world == 1 and not (opts.refused is not None and opts.refusal == "handle"):
                        raise
                    job, staging_s = PersistJob.failed(storage, self.pool, opts, ctx, e), 0.0
            job.seq = ctx.saves
            job.blocking_s = time.perf_counter() - t_start
            copies = job.pending  # before the job runs: it lets go of them when it ends
            try:
                future = self.executor.submit(job.run, t_start, staging_s)
            except RuntimeError:  # at interpreter exit (a manager's on_save that saves): persisted now, here
                future = _run_here(job, t_start, staging_s)
            handle = SaveHandle(storage.location, future, job.blocking_s, staging_s, opts.step, copies=copies)
            self.inflight.append(handle)
            raised = opts.refusal == "call" or (opts.refusal == "alone" and ctx.world == 1)
            if job.early_error is not None and (opts.refused is None or raised):
                raise job.early_error  # this rank's own error, raised here as in one process
        return handle

    def _stage(self, state: Any, storage: Storage, opts: SaveOptions, ctx: DistContext) -> tuple[PersistJob, float]:
        if opts.refused is not None:
            raise CheckpointError(opts.refused)
        # rank 0 alone asks the storage (one request per save, not one per rank); its refusal
        # fails the save on every rank, as any one rank's error does
        if ctx.rank == 0 and not opts.overwrite and _committed_there(storage):
            if ctx.world == 1 and opts.process_group is None and unjoined_launch():
                raise CheckpointError(f"a committed checkpoint already exists at {storage.location}: {unjoined_hint()}")
            raise CheckpointError(
                f"a committed checkpoint already exists at {storage.location}; pass overwrite=True to "
                "replace it (it stays loadable until the new one commits) or save to a new path."
            )
        if ctx.rank == 0:
            _refuse_run_dir(storage)
        tree, tensors, buffers = flatten_with_buffers(state, allow_pickle=opts.allow_pickle)
        layout = self.layouts(tensors, buffers if ctx.world > 1 else ())
        # Once the ranks have agreed a plan for this layout, copy only what it gives this rank to
        # write: a replicated tensor (DDP, HSDP's replicas) is copied by one rank, not by all.
        # The agreement checks that the plan still holds (``_save.agree``).
        keys = layout.expected_writes(ctx) if ctx.world > 1 else None
        specs = layout.specs(keys)
        plan = self.plan(specs, opts.max_shard_bytes, ctx.rank)
        # the same tensors on every save of a structure: asked once, not a device per tensor
        pin_device = layout.remember("pin_device", lambda: cuda_device(layout.sources.values()))
        if pin_device is not None:  # before anything touches CUDA: a pin or a wait breaks a capture
            refuse_capture([torch.device("cuda", pin_device)])
        self.pool.max_free = max(reserved(), opts.max_inflight)  # lowered again once a manager closes
        staged = self.pool.acquire(plan, specs, pin_device)
        t_stage = time.perf_counter()
        pending = None
        try:
            if opts.overlap:
                triples = [(k, layout.sources[k], staged.views[k]) for k in staged.views]
                pending = _overlap.start(state, triples, self.copier, storage.location, layout, staged.starts)
            else:
                stage([(layout.sources[k], staged.views[k]) for k in staged.views], staged.starts)
        except BaseException as e:
            self.pool.release(staged)
            if isinstance(e, Exception) and not isinstance(e, CheckpointError):  # e.g. no GPU memory for a gather
                raise CheckpointError(
                    f"copying the state into staging memory for {storage.location} failed ({type(e).__name__}: {e}); "
                    "nothing was written and earlier checkpoints are untouched"
                ) from e
            raise
        t_staged = time.perf_counter()
        writer = _writerproc.choose(opts.writer, storage, staged)
        job = PersistJob(
            storage, staged, self.pool, tree, layout, opts, ctx, pending=pending, staged_at=t_staged, writer=writer,
            staged_keys=keys, staging_pinned=None if pin_device is None else staged.pinned,
        )  # fmt: skip
        return job, t_staged - t_stage


def _distributed(process_group: Any) -> bool:
    """Whether a save with ``process_group`` (default: the world) spans more than one rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    group = process_group if process_group is not None else dist.group.WORLD
    return len(dist.get_process_group_ranks(group)) > 1


def _run_here(job: PersistJob, t_start: float, staging_s: float) -> cf.Future[Any]:
    future: cf.Future[Any] = cf.Future()
    try:
        future.set_result(job.run(t_start, staging_s))
    except BaseException as e:
        future.set_exception(e)
    return future


def get_engine() -> _Engine:
    return _runtime.slot("save.engine", _Engine, close=_Engine.close, order=10)


def _pending_saves() -> list[cf.Future[Any]]:
    engine = current_engine()
    return [h._future for h in list(engine.inflight) if not h.done()] if engine is not None else []


def current_engine() -> _Engine | None:
    """This process's engine if a save made it, else None (nothing is created)."""
    engine: _Engine | None = _runtime.peek("save.engine")
    return engine


def _committed_there(storage: Storage) -> bool:
    """Whether a checkpoint is committed at ``storage`` already, asked on the caller's thread
    (training waits): within the storage's short limits (object storage: seconds, not the
    minutes a stalled server takes), and where it gives no answer, the exclusive commit at the
    end of the save decides (an error then comes from ``wait()``)."""
    try:
        return storage.best_effort().exists(MANIFEST_NAME)
    except OSError as e:
        log.warning("stashpoint: could not ask whether %s holds a checkpoint (%s); saving on", storage.location, e)
        return False


def _refuse_run_dir(storage: Storage) -> None:
    """A CheckpointManager's run directory is no checkpoint: one saved into it mixes with the
    manager's steps, and ``ls`` and ``verify`` then see neither as they are."""
    if not isinstance(storage, LocalStorage):
        return
    try:
        is_file = storage.root.is_file()
    except OSError as e:  # a name longer than the file system allows, made absolute from a deep directory
        raise CheckpointError(f"{storage.location} cannot be a checkpoint path: {path_problem(e)}") from e
    if is_file:  # refused before anything is staged or written
        raise CheckpointError(
            f"{storage.root} exists and is not a directory; a checkpoint is a directory: remove the file or "
            "choose another path"
        )
    try:
        names = [p.name for p in storage.root.iterdir()]
    except OSError:
        return  # not there yet (the usual case), or a failure the save itself reports
    if LOCK_NAME in names or any(parse_step_dir(n) is not None for n in names):
        raise CheckpointError(
            f"{storage.location} is a CheckpointManager's run directory: save into it through the manager "
            "(mgr.save(step, state)), or save this checkpoint to a path of its own"
        )


def async_save(
    state: Any,
    path: str | os.PathLike[str] | Storage,
    *,
    overwrite: bool = False,
    allow_pickle: bool = False,
    metadata: Mapping[str, str] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    process_group: Any = None,
    timeout: float | None = None,
    overlap: bool = False,
    writer: str = DEFAULT_WRITER,
) -> SaveHandle:
    """Stage ``state`` into host buffers and return; write, checksum, fsync and commit in the background.

    Training may change the state as soon as this returns (with ``overlap=True``: within the
    limits below). A save still in flight in this process is waited for first (one staged copy of
    the state at a time).

    Args:
        state: a dict (or list/tuple) of tensors, plain values and objects with
            ``state_dict()``/``load_state_dict()`` (modules, optimizers, schedulers, ...).
        path: the checkpoint directory to create (``~`` is the home directory, as in a shell).
        overwrite: replace a committed checkpoint at ``path``. The old one stays loadable until
            the new one commits.
        allow_pickle: pickle values that are not otherwise supported (loading them then needs
            ``allow_pickle=True`` too).
        metadata: string key/values stored in the manifest.
        max_shard_bytes: the largest data section of one shard file (default 256 MiB). Local
            storage writes two files at a time (``LocalStorage(path, write_streams=...)``).
        process_group: when ``torch.distributed`` is initialized the save is collective over this
            group (default: the world): every rank calls it with its own state and the same path.
            stashpoint coordinates on its own gloo group over the same ranks, never on this one.
        timeout: seconds a collective step may wait for the other ranks before the save fails
            (default 600).
        overlap: copy the parameters and state tensors of the optimizers in ``state`` in the
            background, while the next forward and backward run, instead of before returning.
            Everything else (buffers such as BatchNorm statistics, plain tensors, parameters no
            optimizer of the state holds) is still copied before returning. Each optimizer's
            ``step()`` waits for the background copies, so the checkpoint is the state at the
            time of the call. Code that changes those tensors in place outside ``step()``
            (``load_state_dict``, EMA or weight updates under ``torch.no_grad``, ...) must call
            ``handle.wait_staged()`` first. See docs/TRAINING.md, "Overlap mode".
        writer: where this rank's shard files are written and checksummed: ``"thread"`` (the
            writer thread of this process) or ``"process"`` (one persistent writer process per
            training process, started on first use, which maps the staging memory: no copy,
            and no GIL time taken from training). The collectives and the commit stay on the
            writer thread either way. Storages other than the built-in local and S3 backends
            are written on the thread. The default is the thread: with direct I/O a persist
            takes little CPU or GIL time, both writers slow the training loop alike, and the
            thread needs no extra process (docs/TRAINING.md, "Writer process").

    Returns:
        a :class:`SaveHandle`; ``wait()`` returns :class:`SaveStats` or raises the failure.
    """
    storage = storage_for(path)
    try:
        opts = SaveOptions(
            overwrite,
            allow_pickle,
            copy_metadata(metadata),
            max_shard_bytes,
            process_group=process_group,
            timeout_s=timeout,
            overlap=overlap,
            writer=writer,
        )
    except (TypeError, ValueError) as e:
        refuse_together(storage, process_group, timeout, e)
        raise
    return get_engine().submit(state, storage, opts)


def refuse_together(storage: Storage, process_group: Any, timeout: float | None, error: Exception) -> None:
    """A distributed save this rank refuses for its arguments still runs its collectives, with
    the refusal: every rank fails it at once (the others learn why from their handles) instead
    of waiting out the timeout, and the ranks' next saves stay in step. The caller raises
    ``error`` on this rank."""
    try:
        if not _distributed(process_group):
            return
        rank = _dist.rank_of(process_group)[0]
        why = f"rank {rank} refused the save: {type(error).__name__}: {error}"
        opts = SaveOptions(
            process_group=process_group, timeout_s=usable_seconds(timeout), refused=why, refusal="handle"
        )
        get_engine().submit(None, storage, opts)
    except Exception as e:  # a group that cannot be made either: the caller's error says enough
        log.debug("stashpoint: could not fail the save on the other ranks too: %s", e)


def save(state: Any, path: str | os.PathLike[str] | Storage, **options: Any) -> SaveStats:
    """Save ``state`` to ``path`` and return once the checkpoint is committed and durable.

    Takes the same options as :func:`async_save`.
    """
    known = inspect.signature(async_save).parameters
    for name in options.keys() - known:
        near = difflib.get_close_matches(name, list(known), n=1)
        raise TypeError(
            f"save() got an unexpected keyword argument {name!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
        )
    handle = async_save(state, path, **options)
    try:
        return handle.wait()
    except KeyboardInterrupt:
        if not handle.done():  # it is not cancelled: a save again to the path finds it committed
            log.warning(
                "stashpoint: interrupted while the save to %s is written: it goes on in the background and commits "
                "(the program's exit waits for it)",
                handle.path,
            )
        raise


def wait_staged(timeout: float | None = None) -> None:
    """Wait until no save of this process is still copying from the live state (``overlap=True``).

    Call before changing the state's tensors in place outside an optimizer step, e.g. before
    loading into them. Failures are not raised here (``SaveHandle.wait()`` raises them).
    """
    _overlap.wait_pending(timeout)


def unjoined_launch() -> bool:
    """Whether a launcher started this process as one of several (``WORLD_SIZE``) that never
    joined (or already left) their process group."""
    import torch.distributed as dist

    size = os.environ.get("WORLD_SIZE", "1").strip()
    return size.isdigit() and int(size) > 1 and not (dist.is_available() and dist.is_initialized())


def unjoined_hint() -> str:
    """What to do when the processes of one launch each save alone to one path."""
    return (
        f"probably another process of this job saved it: WORLD_SIZE={os.environ.get('WORLD_SIZE')} but "
        "torch.distributed is not initialized, so every process saves alone. Call "
        "torch.distributed.init_process_group() before stashpoint (and keep it until the saves are done), or save "
        "from one process only"
    )


def wait_all(location: str | None = None) -> None:
    """Wait for the save in flight in this process, if any (failures are not raised here);
    with ``location``, only for a save to that checkpoint."""
    engine = current_engine()
    if engine is not None:
        cf.wait([h._future for h in list(engine.inflight) if location is None or same_place(h.path, location)])
    if location is None:
        _overlap.wait_pending()
