"""CheckpointManager: a run directory of steps, with retention, bounded saves and crash recovery."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import functools
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from stashpoint._core.naming import step_dir
from stashpoint._core.policy import Retention, Schedule, count_or_none, seconds_or_none
from stashpoint._dist.group import rank_of
from stashpoint._manager import retention, saving
from stashpoint._manager.callbacks import ON_SAVE_THREAD, Awaiting, refuse_on_own_thread, track, unfinished
from stashpoint._manager.lock import Holding
from stashpoint._manager.noderestore import NodeLocal
from stashpoint._manager.preempt import Preemption, signal_name
from stashpoint._manager.preemptstop import stop
from stashpoint._manager.restoring import RestoreReport, restore_reported
from stashpoint._manager.steps import StepMetrics, committed_steps, remove_leftovers, step_number
from stashpoint._manager.tiers import RemoteTier
from stashpoint._save.handle import SaveHandle, SaveStats
from stashpoint._storage import LocalStorage, Storage, storage_for
from stashpoint.errors import CheckpointError

log = logging.getLogger("stashpoint")


class CheckpointManager:
    """Saves a training state every so often into ``root/step-XXXXXXXX`` and keeps the right ones.

    Typical use::

        with stashpoint.CheckpointManager("runs/exp1", keep_last=3, every_steps=500) as mgr:
            start = (mgr.restore(state) or 0) + 1          # None on a fresh run
            for step in range(start, total + 1):
                train_one_step()
                mgr.maybe_save(step, state, metrics={"loss": loss.item()})

    Args:
        root: the run directory (created if needed).
        keep_last: keep the newest N committed steps (None: this rule keeps none).
        keep_every: also keep every step that is a multiple of K, forever.
        keep_best: also keep the K best steps by a metric: ``(K, "metric")`` (lowest is best) or
            ``(K, "metric", "max")``. Pass the metric in ``save(..., metrics=...)``, a finite
            number (rank 0's in a distributed run); a save whose metrics lack it is warned of.
        max_inflight: saves that may be staged or persisting at once. Each holds one staged copy
            of the state in host memory, so this bounds the host memory used for staging.
        on_busy: when ``max_inflight`` saves are in flight, ``"wait"`` blocks until one commits
            (backpressure) and ``"skip"`` skips the new save (logged and counted).
        every_steps, every_seconds: when :meth:`maybe_save` saves (``every_seconds`` counted from
            the manager's creation or its restore, then from each save made: not at the first
            step of a run).
        on_save: called with the :class:`SaveStats` of every save once it commits or is skipped,
            in order, on a thread of the manager's (not the training's, nor the writer's: it may
            save, e.g. export each step); :meth:`wait` and :meth:`close` wait for it (and are
            refused inside it, where they would wait for ever).
        remote_root: a second, durable tier (e.g. ``"s3://bucket/run"`` or a shared filesystem).
            Each step commits to ``root`` first (fast, local), then is copied there in the
            background; steps a crash left un-copied are copied when a manager opens the root
            again. :meth:`restore` prefers a valid local copy and falls back to the remote one.
        remote_keep_last: keep the newest N steps in the remote tier (None: all of them);
            ``keep_every`` and ``keep_best`` apply to both tiers, ``keep_last`` to the local one.
        overlap: save with ``overlap=True`` (see :func:`stashpoint.async_save`) by default.
        writer: the default ``writer`` of this manager's saves, ``"thread"`` or ``"process"``
            (see :func:`stashpoint.async_save`); None: the library's default.
        preemption_deadline: opt in to preemption handling (create the manager in the main
            thread). On one of ``preemption_signals`` the next :meth:`maybe_save` of every rank
            (they agree over a gloo group of stashpoint's own, so a signal to one node is
            enough) waits for the save in flight, saves that step unless it is saved already,
            all within this many seconds, and raises ``SystemExit(128 + signal)``, as the
            signal would have ended the process. Keep it below the launcher's grace period
            (torchrun waits 30 s before SIGKILL). In a distributed run each ``maybe_save`` then
            costs one small all-reduce on that group.
        preemption_signals: the signals that mean preemption (default: SIGTERM, which torchrun,
            Kubernetes and SLURM send before they kill).
        node_local: ``root`` is a directory on each node, not shared (node-local NVMe, or
            ``/dev/shm``): each node's ranks write their files there, every node's leader
            (``LOCAL_RANK`` 0) commits each step, and :meth:`restore` takes the newest step the
            nodes hold between them, fetching onto each node what its ranks read from the
            others (docs/guide/recovery.md). With a ``remote_root``, each rank uploads its own
            files from its node, and a restore reads from the remote copy only what no node
            holds (:attr:`last_restore` says what came from where).
        replicas: with ``node_local``, after each step commits every node's leader also sends
            its node's files of it to the next ``replicas`` nodes, which keep them (for the
            newest step) in their own ``root``: a node lost with its disk is then restored from
            them. At the peak of a save a node holds ``keep_last + 1`` steps of its own files
            and two steps of the copies; a node whose directory cannot hold that takes no copy
            (checked at the first save), and ``wait()`` raises a ``CheckpointError`` saying the step
            is committed but not copied, with the numbers.

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
        remote_root: str | os.PathLike[str] | Storage | None = None,
        remote_keep_last: int | None = None,
        overlap: bool = False,
        writer: str | None = None,
        preemption_deadline: float | None = None,
        preemption_signals: Sequence[int] = (signal.SIGTERM,),
        node_local: bool = False,
        replicas: int = 0,
    ) -> None:
        self.retention = Retention.of(keep_last, keep_every, keep_best)
        count_or_none("remote_keep_last", remote_keep_last)  # without remote_root: unused (configs pass both)
        # the remote tier keeps everything unless remote_keep_last is given
        remote = None if remote_keep_last is None else Retention.of(remote_keep_last, keep_every, keep_best)
        self.remote_retention = remote
        self.overlap = overlap
        self.writer = writer
        self.schedule = Schedule(every_steps, every_seconds)
        self.storage = storage_for(root)
        self.root: Path | str = self.storage.root if isinstance(self.storage, LocalStorage) else self.storage.location
        self.max_inflight = max_inflight
        self.on_busy = on_busy
        if on_save is not None and not callable(on_save):
            raise TypeError(f"on_save must be a function taking SaveStats, not {type(on_save).__name__}")
        self.on_save = on_save
        self.history: collections.deque[SaveStats] = collections.deque(maxlen=1000)
        self.skipped = 0
        self._handles: list[tuple[SaveHandle, cf.Future[None]]] = []
        self._swept = 0  # step directories of saves that never committed, removed at the opening
        self._last_save_time: float | None = time.monotonic()  # every_seconds counts from the opening
        self._lock = threading.Lock()
        self._deleter = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="stashpoint-manager")
        # on_save runs on a thread of its own, so that a slow callback never holds the retention
        # back; the steps it has yet to be called for are kept for it meanwhile
        self._callbacks = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=ON_SAVE_THREAD)
        self._awaiting = Awaiting()
        self._deletions: list[cf.Future[None]] = []
        self._refused: list[cf.Future[Any]] = []  # saves this rank refused, still failing them with the others
        self._closed = False
        self._pid = os.getpid()  # a process forked from this one has none of its threads
        self._shared_checked = False  # every rank sees the root (checked at the first save)
        self.rank, self.world = rank_of()
        saving.check_options(
            self.storage,
            self.world,
            writer=writer,
            max_inflight=max_inflight,
            on_busy=on_busy,
            every_seconds=every_seconds,
            node_local=node_local,
            replicas=replicas,
        )
        self._nodes = NodeLocal(self.world, replicas) if node_local else None
        self._replicas = replicas
        # who looks after the root: rank 0, or with node-local roots each node's leader
        self._owner = self._nodes.owner if self._nodes is not None else self.rank == 0
        self._preemption = None if preemption_deadline is None else Preemption(
            preemption_deadline, preemption_signals, self.world, owner=f"on {self.root}"
        )  # fmt: skip
        self._tier: RemoteTier | None = None
        self._last_restore: RestoreReport | None = None
        self._resumed_at: int | None = None  # the step restored, until the next save (a rewind?)
        self._top: int | None = None  # the highest step this run holds, once a save looked
        self._known: set[int] = set()  # steps found committed in the root (steps() asks for the others alone)
        # not the bound _at: a cycle through it left a manager dropped unclosed (and its root
        # locked) for the cyclic collector, which a quiet program may not run for long
        self._metrics = StepMetrics(functools.partial(_step_at, weakref.ref(self)), self._known)
        self._remote_rewind: int | None = None  # a rewind's remote steps above this, for its upload to move
        self._remote_unseen = False  # the last restore could not list the remote tier: no rewind reaches it
        self.storage.prepare()
        # In a distributed run rank 0 owns the root: the lock, the cleanup and the retention.
        # (Object stores offer no lock: there, one manager per root is the user's to ensure.)
        owned = self.storage.root if self._owner and isinstance(self.storage, LocalStorage) else None
        self._hold = Holding(self, owned, max_inflight)
        try:
            if self._owner:  # how many: a restore that then finds no step says so
                self._swept = remove_leftovers(self.storage)
            if remote_root is not None:
                self._tier = RemoteTier(
                    self.storage,
                    remote_root,
                    self.remote_retention,
                    self._metrics.of,
                    self.rank,
                    functools.partial(_upload_ended, weakref.ref(self)),  # no cycle (see _metrics)
                    owner=self._owner,
                    node_local=self._nodes is not None,
                    forget=self._metrics.forget,
                    keeper=weakref.ref(self),
                )
            if self._preemption is not None:
                self._preemption.install(self)
        except BaseException:
            self._release()
            raise
        track(self)

    @property
    def remote(self) -> Storage | None:
        """The remote tier's root (None without ``remote_root``)."""
        return self._tier.remote if self._tier is not None else None

    # -- listing -------------------------------------------------------------------------------

    def path(self, step: int) -> Path | str:
        """Where ``step`` lives: a directory under a local root, a URL under a remote one."""
        target = self._at(step_number(step))
        return target.root if isinstance(target, LocalStorage) else target.location

    def _at(self, step: int) -> Storage:
        if isinstance(self.storage, LocalStorage):
            return self.storage_class(self.storage.root / step_dir(step))
        return self.storage.child(step_dir(step))

    def steps(self) -> list[int]:
        """Committed steps, oldest first. Saves in progress and crashed saves are not listed."""
        return committed_steps(self.storage, self._known)

    def remote_steps(self) -> list[int]:
        """Committed steps in the remote tier, oldest first ([] without a ``remote_root``)."""
        return self._tier.steps() if self._tier is not None else []

    def latest_step(self) -> int | None:
        """The newest committed step, or None when the root holds none."""
        steps = self.steps()
        return steps[-1] if steps else None

    # -- saving --------------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether a save is due at ``step`` by ``every_steps`` / ``every_seconds``; never at the
        step the last :meth:`restore` loaded, before a save (it is committed already)."""
        if not self.schedule.configured:
            raise ValueError(
                "should_save and maybe_save need a schedule: pass every_steps and/or every_seconds to the "
                "CheckpointManager, or call save() when a save is due"
            )
        step = step_number(step)
        if step == self._resumed_at:  # a loop resuming with range(start, ...) passes it again
            return False
        return self.schedule.due(step, time.monotonic(), self._last_save_time)

    def maybe_save(
        self, step: int, state: Any, *, metrics: Mapping[str, float] | None = None, **options: Any
    ) -> SaveHandle | None:
        """Save if :meth:`should_save` says so; return the handle, or None when no save was due.

        With ``preemption_deadline``, first agree whether a preemption signal came (on any rank):
        if so, save this step and exit (see the class docstring)."""
        step = step_number(step)
        if self._preemption is not None:
            signum = self._preemption.agreed(step)
            if signum is not None:
                if self._nodes is not None:  # the last restore's copy to disk gives way to the deadline
                    self._nodes.settled(stop=True)
                options["on_busy"] = "wait"  # never skipped because another save of the process runs
                emergency = functools.partial(self.save, step, state, metrics=metrics, **options)
                stop(self, self._preemption, signum, step, emergency)
        return self.save(step, state, metrics=metrics, **options) if self.should_save(step) else None

    def in_flight(self) -> list[tuple[SaveHandle, cf.Future[None]]]:
        """This manager's saves not yet done, with the futures of their bookkeeping."""
        with self._lock:
            return [(h, a) for h, a in self._handles if not a.done()]

    def save(self, step: int, state: Any, *, metrics: Mapping[str, float] | None = None, **options: Any) -> SaveHandle:
        """Start an asynchronous save of ``state`` as ``step``; returns once the state is staged.

        ``options`` are those of :func:`stashpoint.async_save` (``allow_pickle``, ``metadata``,
        ``max_shard_bytes``, ``overlap``). Older steps are deleted by the retention rules in the
        background once this one has committed. With a ``remote_root``, the step is then copied
        to the remote tier in the background.
        """
        self._check_open()
        self._check_process("save with it")
        step, plain = step_number(step), saving.plain_metrics(metrics)
        saving.check_metrics(self, step, plain)
        return saving.start_save(self, step, state, plain, options)

    # -- retention -----------------------------------------------------------------------------

    # -- restoring -----------------------------------------------------------------------------

    def restore(self, state: Any, step: int | None = None, *, strict: bool = True, **options: Any) -> int | None:
        """Load ``step`` (default: the newest committed one) into ``state``; return the step.

        Returns None when the root holds no committed checkpoint, so resuming is one line. When
        no step is given and the newest checkpoint turns out damaged, the error is logged, the
        next older one is tried, and the damaged steps are moved aside (renamed
        ``step-XXXXXXXX.damaged-<time>``, kept for inspection, never listed again) so that
        training can save those steps anew. ``options`` are those of :func:`stashpoint.load`
        (``verify``, ``allow_pickle``, ``exchange``, ``timeout``, ``process_group``).

        With a ``remote_root``, a step's local copy is preferred when every rank has it, and
        the remote copy is used otherwise (a fresh node) or when the local one is damaged.

        Going back (``step`` below the newest step, then training on): the first save after it
        moves the steps above ``step`` aside (``step-XXXXXXXX.rewound-<time>``, both tiers), so
        that the retention and a later restart take the new run's steps for the newest.
        """
        self._check_open()
        if self.world > 1:  # a forked child has none of the parent's place in the group
            self._check_process("restore with it")
        seconds_or_none("timeout", options.get("timeout"))  # before the ranks agree on what to read
        step = None if step is None else step_number(step)
        self._last_restore = r = restore_reported(self, state, step, strict, options)
        self._resumed_at = r.step
        self._last_save_time = time.monotonic()  # every_seconds counts from here: a restore may take minutes
        return r.step

    def restored_from(self) -> str | None:
        """Which tier the last :meth:`restore` read: "local", "remote", or None."""
        return self._last_restore.tier if self._last_restore is not None else None

    @property
    def preempted(self) -> bool:
        """Whether this rank got a preemption signal (``preemption_deadline``) not yet answered at
        a :meth:`maybe_save`: a long evaluation can check it and return to the training loop,
        whose next ``maybe_save`` saves and exits. False without preemption handling."""
        p = self._preemption
        return p is not None and p.signum is not None and not p.handled

    @property
    def last_restore(self) -> RestoreReport | None:
        """What the last :meth:`restore` did on this rank: the step, the tier, the fall-back
        order, the copies passed by and why, the bytes fetched from other nodes and from the
        remote tier (None before any restore)."""
        return self._last_restore

    # -- lifecycle -----------------------------------------------------------------------------

    def wait(self) -> None:
        """Wait for this manager's saves, uploads and deletions; raise the first failure, if any
        (a save's first, then an upload's). A save's failure that its handle's ``wait()`` already
        raised (or ``exception()`` returned) is not raised again."""
        if os.getpid() != self._pid:  # no lock taken: one held by a thread at the fork stays held here
            if unfinished(self, locks=False):
                self._check_process("wait for them")
            return
        saving.wait_for(self)

    def close(self) -> None:
        """Wait for pending saves and deletions, then release the root. A preemption signal that
        came after the last :meth:`maybe_save` is raised again once the manager is closed."""
        if self._closed:
            return
        if os.getpid() != self._pid:  # a forked child's copy: the parent's saves are its own to end
            self._closed = True
            return
        refuse_on_own_thread(self, "close")
        try:
            self.wait()
        except Exception:
            self._shut()
            raise
        except BaseException:
            # Ctrl-C: the root stays held and the manager open while saves are in flight, or
            # another manager would take the step being written for a leftover and remove it;
            # close() again, or the program's exit, ends them
            log.warning(
                "stashpoint: close() of the CheckpointManager on %s was interrupted; it stays open (and %s held) "
                "until its saves end: call close() again",
                self.root,
                self.root,
            )
            raise
        self._shut()

    def _shut(self) -> None:
        """close() once the waiting is over (also when it raised a save's failure)."""
        if self._tier is not None:
            self._tier.close()
        pending = self._preemption.close() if self._preemption is not None else None
        if self._nodes is not None:
            self._nodes.close()
        with self._lock:
            self._closed = True
        self._release()
        if pending is not None:  # also when wait() raised: a failed save must not swallow the signal
            log.warning(
                "stashpoint: %s came after the last maybe_save; the manager closed, it takes its course",
                signal_name(pending),
            )
            signal.raise_signal(pending)

    def _release(self) -> None:
        try:
            self._callbacks.shutdown(wait=True)  # first: a callback's end applies the retention
            self._deleter.shutdown(wait=True)
        finally:  # the root is released even where the threads could not be joined
            self._hold.release()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"this CheckpointManager on {self.root} is closed; create a new one")

    def _check_process(self, what: str) -> None:
        if os.getpid() != self._pid:
            raise CheckpointError(
                f"this CheckpointManager on {self.root} belongs to process {self._pid}, which this process was "
                f"forked from: its saves run there, and this one cannot {what}; create a manager in this process, "
                "on another root"
            )

    def __enter__(self) -> CheckpointManager:
        self._check_open()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if et is None:
            self.close()
            return
        try:  # do not hide the exception already on its way out
            self.close()
        except CheckpointError as e:
            log.error("stashpoint: while closing the manager: %s", e)

    def __repr__(self) -> str:  # no listing: a debugger's repr must not read the storage (S3: requests)
        return f"<CheckpointManager {self.root}{' closed' if self._closed else ''}>"


def _step_at(ref: weakref.ref[CheckpointManager], step: int) -> Storage:
    mgr = ref()
    if mgr is None:  # asked only through a live manager's retention
        raise CheckpointError("the CheckpointManager is gone")
    return mgr._at(step)


def _upload_ended(ref: weakref.ref[CheckpointManager]) -> None:
    mgr = ref()
    if mgr is not None:
        retention.upload_ended(mgr)
