"""The parts of ``CheckpointManager.save`` around the engine's: the step's directory made
ready, the options a manager's save passes on, and its bookkeeping once the save ends
(history, metrics, retention, the clean-up of a failed save)."""

from __future__ import annotations

import concurrent.futures as cf
import decimal
import json
import logging
import numbers
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from stashpoint._core.format import utc_stamp
from stashpoint._core.naming import MANIFEST_NAME
from stashpoint._core.policy import flag, metric_problem, usable_seconds
from stashpoint._manager import retention
from stashpoint._manager.aftersave import holds_manifest_or_unknown, out_of_space, say_room
from stashpoint._manager.callbacks import call_on_save, refuse_on_own_thread, settle
from stashpoint._manager.lock import check_shared_root
from stashpoint._manager.rewindmark import Rewind
from stashpoint._manager.setaside import set_aside_newer
from stashpoint._manager.steps import (
    METRICS_KEY,
    clear_leftover,
    holds_manifest,
    move_aside,
    remove_leftover,
)
from stashpoint._save.engine import get_engine, refuse_together
from stashpoint._save.handle import SaveHandle, SaveStats
from stashpoint._save.options import SaveOptions
from stashpoint._storage import LocalStorage, Storage
from stashpoint.errors import CheckpointError, ReplicaError

if TYPE_CHECKING:
    from stashpoint._manager.manager import CheckpointManager

log = logging.getLogger("stashpoint")


def plain_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """``metrics`` as JSON scalars: numbers, strings, booleans and None as they are, a NumPy
    scalar as the number it holds; raises ``TypeError`` naming the key of anything else (a
    tensor: its ``.item()`` is the caller's to take, as it waits for the GPU)."""
    out: dict[str, Any] = {}
    if metrics is not None and not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a dict of names to numbers, e.g. {{'loss': 0.5}}; got {metrics!r}")
    for key, value in (metrics or {}).items():
        if not isinstance(key, str):
            raise TypeError(f"metrics keys must be strings, got {key!r}")
        if value is None or isinstance(value, (str, bool, int, float)):
            out[key] = value
        elif type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
            out[key] = value.item()  # a NumPy scalar: the Python number, bool or string it holds
        elif isinstance(value, (numbers.Real, decimal.Decimal)):  # fractions, decimals
            out[key] = float(value)
        else:
            hint = (
                "pass a number, e.g. loss.item() (which waits for the GPU when the tensor is on one)"
                if hasattr(value, "item")
                else "pass a number, a string, a boolean or None"
            )
            raise TypeError(f"metrics[{key!r}] is a {type(value).__name__}, not a JSON scalar: {hint}")
    return out


def check_metrics(mgr: CheckpointManager, step: int, metrics: dict[str, Any]) -> None:
    """Say once per kind (on rank 0, whose metrics the retention reads) when a save's metrics
    will not compete for ``keep_best``: the best steps would be deleted with no word."""
    found = metric_problem(metrics, mgr.retention) if mgr.rank == 0 else None
    if found is not None and found[0] not in mgr._metrics.said:
        mgr._metrics.said.add(found[0])
        log.warning("stashpoint: step %d will not count for keep_best: %s (said once)", step, found[1])


def check_options(
    storage: Storage,
    world: int,
    *,
    writer: str | None,
    max_inflight: int,
    on_busy: str,
    every_seconds: float | None,
    node_local: bool,
    replicas: int,
) -> None:
    """Refuse, at the manager's creation, what its saves could not do (``ValueError``), and a
    checkpoint given as the run directory (every rank sees it: a local directory is shared or
    each node's own)."""
    flag("node_local", node_local)
    if isinstance(storage, LocalStorage) and storage.exists(MANIFEST_NAME):
        raise CheckpointError(
            f"{storage.location} is a checkpoint (it holds {MANIFEST_NAME}), not a run directory: give "
            "CheckpointManager the directory its step-* checkpoints go in, and load this one with stashpoint.load"
        )
    if writer is not None:
        SaveOptions(writer=writer)  # validates
    SaveOptions(max_inflight=max_inflight, on_busy=on_busy)  # validates
    if world > 1 and every_seconds is not None:  # refused here, not at the first maybe_save
        raise ValueError(
            "every_seconds would let ranks decide differently in a distributed run (their clocks differ); "
            "use every_steps, or decide on rank 0 and broadcast the decision on your own group"
        )
    if world > 1 and on_busy == "skip":
        raise ValueError("on_busy='skip' would let ranks skip different saves in a distributed run; use 'wait'")
    if node_local and not isinstance(storage, LocalStorage):
        raise ValueError(f"node_local=True needs a local directory as root, not {storage.location}")
    if isinstance(replicas, bool) or not isinstance(replicas, numbers.Integral) or replicas < 0:
        raise ValueError(f"replicas must be a whole number of copies, 0 or more, got {replicas!r}")
    if replicas and not node_local:
        raise ValueError("replicas need node_local=True: they are copies of each node's files on other nodes")


def save_options(mgr: CheckpointManager, step: int, metrics: dict[str, float], options: dict[str, Any]) -> SaveOptions:
    """The engine's options for ``mgr``'s save of ``step``: the caller's ``options`` with the
    metrics in the metadata, the node-local plan, and the manager's defaults; raises
    ``ValueError`` for what a manager's save does not support."""
    meta = dict(options.pop("metadata", None) or {})
    if METRICS_KEY in meta:  # it was replaced in silence
        raise ValueError(
            f"metadata key {METRICS_KEY!r} is the manager's own (the step's metrics): pass metrics=... or "
            "name the key otherwise"
        )
    meta[METRICS_KEY] = json.dumps(metrics)
    if "timeout" in options:
        options["timeout_s"] = options.pop("timeout")
    if mgr._nodes is not None:
        if options.get("process_group") is not None:
            raise ValueError(
                "a node-local CheckpointManager saves over the whole world; process_group is not supported"
            )
        # the emergency save of a preempted job takes no copies: the deadline is for its commit
        stopping = mgr._preemption is not None and mgr._preemption.stopping
        options["nodes"] = mgr._nodes.for_save(0 if stopping else mgr._replicas, mgr.retention.bound())
    if mgr._tier is not None and options.get("process_group") is not None:
        raise ValueError(
            "a CheckpointManager with a remote_root uploads over the whole world; saving over a process_group "
            "is not supported with tiers (use a manager without remote_root)"
        )
    if mgr.overlap:
        options.setdefault("overlap", True)
    if mgr.writer is not None:
        options.setdefault("writer", mgr.writer)
    options.setdefault("on_busy", mgr.on_busy)
    return SaveOptions(metadata=meta, max_inflight=mgr.max_inflight, step=step, **options)


def after_save(  # noqa: PLR0917
    mgr: CheckpointManager,
    step: int,
    metrics: dict[str, float],
    future: cf.Future[SaveStats],
    after: cf.Future[None],
    resumed: int | None = None,
) -> None:
    """Once ``mgr``'s save of ``step`` ended: its stats and metrics recorded and the retention
    rules applied in the background, or a failed save's directory removed (and the restore of
    ``resumed`` it followed still the last thing done, for the next save); ``after`` is set
    done in every case."""
    handed = False  # ``after`` is the callback's to set
    try:
        error = future.exception()
        if error is not None and not isinstance(error, ReplicaError):
            with mgr._lock:
                if mgr._resumed_at is None:
                    mgr._resumed_at = resumed
            # node-local: a failed save is no step of the job even where its manifest landed
            if mgr._owner and (mgr._nodes is not None or not holds_manifest_or_unknown(mgr._at(step))):
                remove_leftover(mgr._at(step))
            if mgr._owner and out_of_space(error):
                say_room(mgr, step)
            return
        if error is not None:  # committed, not copied to other nodes: kept, and raised by wait()
            with mgr._lock:
                if mgr._owner:  # only the owner's retention reads (and forgets) them
                    mgr._metrics.put(step, metrics)
                    retention.retain_later(mgr)
            return
        stats = future.result()
        with mgr._lock:
            mgr.history.append(stats)
            if stats.skipped:
                mgr.skipped += 1
            elif mgr._owner:
                mgr._metrics.put(step, metrics)
                if mgr.on_save is not None:  # kept until the callback for it has run
                    mgr._awaiting.add(step, mgr.storage.location)
                retention.retain_later(mgr)
        if mgr.on_save is not None:
            call_on_save(mgr, mgr.on_save, step, stats, after)
            handed = True
    finally:
        if not handed:
            after.set_result(None)


#: What ``CheckpointManager.save`` passes on to the engine: ``async_save``'s options but
#: ``overwrite`` (a manager decides what a step's directory holds), and ``on_busy``.
SAVE_OPTIONS = frozenset(
    {"allow_pickle", "metadata", "max_shard_bytes", "overlap", "writer", "timeout", "process_group", "on_busy"}
)


def start_save(
    mgr: CheckpointManager, step: int, state: Any, metrics: dict[str, Any], options: dict[str, Any]
) -> SaveHandle:
    """``CheckpointManager.save`` once its arguments are checked: the step's directory made
    ready, the engine's save started, and its bookkeeping (:func:`after_save`, the upload)
    attached to it."""
    if unknown := sorted(set(options) - SAVE_OPTIONS):
        raise TypeError(
            f"CheckpointManager.save() got unexpected option(s) {', '.join(map(repr, unknown))}; it takes "
            f"{', '.join(sorted(SAVE_OPTIONS))}"
        )
    # the options checked before anything is moved aside, and a collective never given their
    # timeout unchecked (NaN or inf broke it, and the next save): refused below, with the others
    try:
        save_options(mgr, step, metrics, {k: v for k, v in options.items() if k != "process_group"})
        bad = None
    except (TypeError, ValueError) as e:
        bad = e
    if not mgr._shared_checked and mgr._nodes is None and isinstance(mgr.storage, LocalStorage):
        check_shared_root(mgr.storage.root, options.get("process_group"), usable_seconds(options.get("timeout")))
        mgr._shared_checked = True
    target = mgr._at(step)
    if mgr._nodes is not None:  # the last restore's fetched files are in the node's directory first
        mgr._nodes.settled()
    with mgr._lock:
        if any(h.step == step and not a.done() for h, a in mgr._handles):
            raise CheckpointError(
                f"step {step} is still being saved to {target.location}; wait for that save (mgr.wait()) first"
            )
    if bad is not None:
        _refuse(mgr, step, target, options, bad)
        raise bad
    resumed = mgr._resumed_at
    going_back, refused = set_aside_newer(mgr, step)
    there = (
        f"step {step} already has a committed checkpoint at {target.location}; save under a new step, or "
        "delete that directory first."
    )
    # one root: its owner asks (one request a save, not one a rank, and no rank whose answer
    # lags submits a save the others refused); node-local roots: each rank its node's own
    ask = mgr._owner or mgr._nodes is not None
    storage_failed = False
    try:  # within the storage's short limits (object storage: seconds, not its minute and a half)
        committed = ask and refused is None and not going_back and target.best_effort().exists(MANIFEST_NAME)
    except OSError as e:  # this rank's alone: failed through the engine with the others
        committed, refused = False, f"could not tell whether {target.location} holds a checkpoint: {e}"
        storage_failed = True
    if committed:
        refused = there
    # a refusal of one rank (an owner that could not move a step aside; a node-local step one
    # node holds and another, on a new disk, not): the engine fails the save on every rank
    # together instead of leaving those waiting for this one
    if mgr._owner and refused is None:  # the remains of an earlier failed save of this step, if any
        # the owner's alone, on the caller's thread within the storage's short limits; a refusal
        # fails the save through the engine on every rank together
        quick = target.best_effort()
        try:
            if not holds_manifest(quick):
                refused = clear_leftover(quick)
            elif not going_back:  # the HEAD above said none (a lagging store): a step already there
                refused = there
            elif not move_aside(mgr.storage, step, "rewound"):
                # committed once (a manifest this process cannot read now is no leftover): kept
                refused = f"step {step} at {target.location} holds a committed checkpoint that could not be moved aside"
        except OSError as e:
            refused = f"could not tell what {target.location} holds before saving step {step} there: {e}"
            storage_failed = True
    # any refusal saves nothing: the next save decides anew, as set_aside_newer's refusals (now,
    # not when the refusal arrives by the handle)
    if refused is not None:
        mgr._top, mgr._resumed_at, mgr._remote_rewind = None, resumed, None
    if refused is None and mgr._remote_rewind is not None and mgr._tier is not None:  # rank 0
        mark = Rewind(mgr._remote_rewind, mgr._tier.remote.location, utc_stamp())
        mgr._tier.uploader.note_rewind(mark)  # moved by this step's upload, or a later one
    mgr._remote_rewind = None
    # one root: its owner alone refuses, and every rank learns of it alike, from its handle
    # a storage that failed a check fails the save through its handle: training goes on
    refusal = "handle" if storage_failed else "call" if mgr._nodes is not None else "alone"
    last, mgr._last_save_time = mgr._last_save_time, time.monotonic()
    try:
        try:
            opts = save_options(mgr, step, metrics, {**options, "refused": refused, "refusal": refusal})
        except (TypeError, ValueError) as e:  # the others' save fails at once too, and is tracked below
            refuse_together(target, options.get("process_group"), usable_seconds(options.get("timeout")), e)
            raise
        handle = get_engine().submit(state, target, opts)
    except BaseException as e:
        if mgr._resumed_at is None:  # no step was saved: the next save is the first after the restore still
            mgr._resumed_at = resumed
        _track_refused(mgr, step, target, e)
        raise
    if handle.stats is not None and handle.stats.skipped:  # no save: every_seconds counts from the last one made
        mgr._last_save_time = last
    after: cf.Future[None] = cf.Future()  # done once the bookkeeping below has run too
    with mgr._lock:
        # keep saves in flight, and failed ones until wait() or their own handle has reported them
        mgr._handles = [
            (h, a) for h, a in mgr._handles if not a.done() or (h._failure() is not None and not h._reported)
        ]
        mgr._handles.append((handle, after))
    # a refused save's bookkeeping was reset above: a later save may have started when it arrives
    restore_at = None if refused is not None else resumed
    held = [mgr]  # let go once called: the engine keeps the handle, and a future its callbacks
    handle._future.add_done_callback(lambda f: after_save(held.pop(), step, metrics, f, after, restore_at))
    if mgr._tier is not None:
        mgr._tier.submit(step, handle._future)
    return handle


def _refuse(mgr: CheckpointManager, step: int, target: Storage, options: dict[str, Any], error: Exception) -> None:
    """This rank refuses the save of ``step`` for its options, nothing moved aside: the other
    ranks' save fails at once too (as ``start_save``'s own refusals)."""
    refuse_together(target, options.get("process_group"), usable_seconds(options.get("timeout")), error)
    _track_refused(mgr, step, target, error)


def _track_refused(mgr: CheckpointManager, step: int, target: Storage, error: BaseException) -> None:
    """A save this rank refused still runs its collectives, to fail it on every rank: wait()
    and close() wait for them, so that a program ending on this error does not cut them."""
    queued = [h._future for h in get_engine().inflight if h.path == target.location and not h.done()]
    with mgr._lock:
        mgr._refused = [f for f in mgr._refused if not f.done()] + queued
    if mgr._tier is not None and mgr.world > 1:  # the other ranks queue this step's upload: so do we
        failed: cf.Future[Any] = cf.Future()
        failed.set_exception(error)
        mgr._tier.submit(step, failed)


def wait_for(mgr: CheckpointManager) -> None:
    """``CheckpointManager.wait``: every save, upload and deletion of ``mgr`` ended, those that
    others start meanwhile too (a save an ``on_save`` callback starts); the first failure
    raised (a save's first, then an upload's), except a save's that its own handle already
    raised or returned. Callers on other threads each wait for all of it (a ``close()`` beside
    a ``wait()`` must not release the root under a save); a failure is raised to one of them."""
    refuse_on_own_thread(mgr, "wait")
    settle(mgr)
    with mgr._lock:
        ended = [(h, a) for h, a in mgr._handles if a.done()]
        mgr._handles = [(h, a) for h, a in mgr._handles if not a.done()]
        mgr._refused = [f for f in mgr._refused if not f.done()]  # their errors were raised at their save
    uploads = mgr._tier.take_ended() if mgr._tier is not None else []
    for h, _ in ended:
        exc = h._failure()
        if exc is not None and not h._reported:  # one the caller caught from h.wait() is not raised again
            raise exc
    for u in uploads:
        err = u.exception()
        if err is not None:
            raise err
