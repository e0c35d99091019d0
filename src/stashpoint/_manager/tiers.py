"""Two storage tiers: each step commits to fast local storage, then is copied to a remote one
(by the uploader, ``_manager/uploader``).

:class:`RemoteTier` is what the manager holds: the remote root, its retention, the uploader, and
the local steps that must not be deleted yet (their upload is pending or failed).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from stashpoint._core.naming import step_dir
from stashpoint._core.policy import Doubling, Retention
from stashpoint._manager.rewindmark import Rewind, live, pending_rewind
from stashpoint._manager.steps import committed_steps, delete_step, remove_leftovers, retained
from stashpoint._manager.uploader import Uploader
from stashpoint._save import teardown
from stashpoint._storage import LocalStorage, Storage, storage_for
from stashpoint.errors import CheckpointError

log = logging.getLogger("stashpoint")

#: How many times a run uploads again a step whose upload failed, each after an upload that committed.
MAX_RETRIES = 3

#: Warn when more than this many local steps wait for their upload (uploads slower than saves).
BACKLOG_WARNING = 3


def restore_order(local: Sequence[int], remote: Sequence[int], step: int | None) -> list[tuple[int, str]]:
    """The copies a restore tries, in order: ``(step, "local" | "remote")``.

    Newest step first; for each step the local copy (when every rank has it) before the remote
    one. With ``step`` given, only that step's copies.
    """
    steps = sorted(set(local) | set(remote), reverse=True) if step is None else [step]
    order = []
    for s in steps:
        if s in local:
            order.append((s, "local"))
        if s in remote:
            order.append((s, "remote"))
    return order


def same_root(a: Storage, b: Storage) -> bool:
    """Whether two roots are the same place (or one holds the other, for local paths)."""
    if isinstance(a, LocalStorage) and isinstance(b, LocalStorage):
        ra, rb = os.path.realpath(a.root), os.path.realpath(b.root)
        return ra == rb or ra.startswith(rb + os.sep) or rb.startswith(ra + os.sep)
    return a.location.rstrip("/") == b.location.rstrip("/")


class RemoteTier:
    """The remote tier of a manager: where steps are copied, what it keeps, what is in flight."""

    def __init__(  # noqa: PLR0917
        self,
        local: Storage,
        remote_root: str | os.PathLike[str] | Storage,
        retention: Retention | None,
        metrics: Callable[[int, Storage], dict[str, Any] | None],
        rank: int,
        on_ended: Callable[[], None] | None = None,
        *,
        owner: bool = False,
        node_local: bool = False,
        forget: Callable[[int], None] | None = None,
        keeper: Callable[[], Any] | None = None,
    ) -> None:
        # keeper: a weak reference to the manager, held strongly while uploads are pending: a
        # manager dropped unclosed keeps its root (the lock) until they end, as for its saves
        self._keeper, self._kept = keeper, None
        self.local = local
        self.remote = storage_for(remote_root)
        if same_root(self.remote, local):
            raise ValueError(
                f"remote_root must be another place than root (root {local.location}, remote_root "
                f"{self.remote.location})"
            )
        self.retention = retention  # None: keep every remote step
        self.metrics = metrics
        self.forget = forget  # a remote step deleted: the metrics read of it may go
        self.rank = rank
        self.on_ended = on_ended  # after every upload (or catch-up): local steps it protected may go
        self.futures: list[cf.Future[Any]] = []
        self._lock = threading.Lock()
        teardown.watch(self)  # a program's destroy_process_group() waits for its uploads
        self._pending: collections.Counter[int] = collections.Counter()  # uploads queued, per step
        self._failed: set[int] = set()  # steps whose upload failed: kept until one commits
        # (rank 0) retries started, per step: counted as they start, not as they are listed (the
        # upload they were listed with may fail, and they with it, untried)
        self._retried: collections.Counter[int] = collections.Counter()
        self._known: set[int] = set()  # remote steps found committed (their manifests not asked again)
        self._backlog = Doubling(BACKLOG_WARNING)  # when a growing upload backlog is said
        todo: list[int] = []
        problem = None
        # a rewind the remote tier has not seen (none is written down in a node-local root)
        rewound = pending_rewind(local, self.remote.location) if rank == 0 and not node_local else None
        try:
            self.remote.prepare()
            if rank == 0:
                remove_leftovers(self.remote)
                todo = self._missing(rewound)
        except (OSError, CheckpointError) as e:  # the remote tier is a second copy: training goes on
            problem = f"{type(e).__name__}: {e}"
        self.uploader = Uploader(
            local,
            self.remote,
            on_result=self._result,
            on_committed=self._retain,
            node_local=node_local,
            retry=self._failed_to_retry if rank == 0 else None,
            on_dropped=self._give_up,
            on_retrying=self._retried.update if rank == 0 else None,
        )
        if self.uploader.ctx.world > 1:  # the catch-up below starts before any save could install it
            teardown.install()
        if rewound is not None:  # the catch-up below and every upload after move them first
            self.uploader.note_rewind(rewound, since=0, write=False)
        # every owner of a directory's retention (node-local: each node's leader) protects them
        todo, first = self.uploader.ctx.broadcast("upload: what the remote tier lacks", (todo, problem))
        problem = problem or first
        if problem is not None:
            log.warning(
                "stashpoint: the remote tier %s cannot be reached now (%s); the local steps are kept until they "
                "are uploaded (after this run's first upload that commits, or by a manager opened later)",
                self.remote.location,
                problem,
            )
            todo = []
        with self._lock:
            if problem is not None and owner:
                self._failed.update(committed_steps(local))
            self._pending.update(todo)
            self._hold()
        self._track(self.uploader.catch_up(todo))

    def _hold(self) -> None:
        """(Under the lock.) Keep the manager while uploads are pending."""
        if self._pending and self._kept is None and self._keeper is not None:
            self._kept = self._keeper()

    def _failed_to_retry(self) -> tuple[list[int], list[int]]:
        """(Rank 0, on the upload thread, as an upload is about to go up) the steps whose uploads
        failed that are to go up after it, and those to give up on: gone from the local root, or
        steps the remote retention would delete at once."""
        with self._lock:
            failed = sorted(self._failed - self._pending.keys())
        if not failed:
            return [], []
        try:  # never raised: the ranks wait for the decision this goes with
            local = set(committed_steps(self.local))
            todo = [s for s in failed if s in local]
            if self.retention is not None and todo:
                keep = self._remote_keeps(self.retention, local, committed_steps(self.remote, self._known))
                todo = [s for s in todo if s in keep]
        except (OSError, CheckpointError) as e:  # the tiers cannot say now: asked again at the next upload
            log.info("stashpoint: the failed uploads are not retried yet: %s", e)
            return [], []
        dropped = [s for s in failed if s not in todo]
        # a copy that fails whenever the remote tier answers (damaged, no node holds it whole) is
        # not copied again after every upload: kept for a manager opened later
        todo = [s for s in todo if self._retried[s] < MAX_RETRIES]
        return todo, dropped

    def _give_up(self, steps: list[int]) -> None:
        """Failed uploads no longer kept for (the remote retention would not keep them)."""
        with self._lock:
            self._failed.difference_update(steps)
        if self.on_ended is not None:
            self.on_ended()

    def _missing(self, rewound: Rewind | None) -> list[int]:
        """Local steps the remote tier lacks and would keep (rank 0, at open); its steps above a
        rewind it has not seen (``rewound``) are another run's, about to be moved aside."""
        local = committed_steps(self.local)
        remote = live(committed_steps(self.remote), rewound, self.remote, self.local)
        missing = [s for s in local if s not in remote]
        if self.retention is None or not missing:
            return missing
        keep = self._remote_keeps(self.retention, set(local), remote)
        return [s for s in missing if s in keep]

    def _remote_keeps(self, retention: Retention, local: set[int], remote: Iterable[int]) -> set[int]:
        """The steps the remote ``retention`` keeps of those both tiers hold between them (a step
        only the remote tier holds has its metrics there)."""
        everything = sorted(local | set(remote))
        return retained(everything, lambda s: self.metrics(s, self.local if s in local else self.remote), retention)

    def submit(self, step: int, after: cf.Future[Any]) -> None:
        with self._lock:
            self._pending[step] += 1
            self._hold()
            self._retried.pop(step, None)  # a new copy of the step (after a rewind): its own retries
            backlog = len(self._pending.keys() | self._failed)
            failed = len(self._failed - self._pending.keys())
            louder = self._backlog.louder(backlog)
        if louder:
            log.warning(
                "stashpoint: %d local steps wait for their upload to %s: %s (each waiting step stays on the local "
                "tier)",
                backlog,
                self.remote.location,
                f"{failed} of them failed to upload and are tried again after the next upload that commits"
                if failed
                else "uploads are slower than saves",
            )
        self._track(self.uploader.submit(step, after))

    def settle(self) -> None:
        """Wait for the uploads queued so far (their failures stay for ``wait()``)."""
        with self._lock:
            pending = list(self.futures)
        cf.wait(pending)

    def protected(self) -> set[int]:
        """Local steps retention must keep: their upload is pending, or failed."""
        with self._lock:
            return set(self._pending) | self._failed

    def steps(self) -> list[int]:
        return committed_steps(self.remote, self._known)

    def at(self, step: int) -> Storage:
        return self.remote.child(step_dir(step))

    def _result(self, step: int, uploaded: bool | None) -> None:
        """On the uploader thread, after each step (before its future completes, so that the
        manager's ``wait()`` also waits for the retention scheduled here)."""
        with self._lock:
            self._pending[step] -= 1
            if self._pending[step] <= 0:
                del self._pending[step]
            # failed: the local copy stays until an upload of it commits; uploaded: what a
            # failure kept is there now (a new save of the step after the failed copy was set
            # aside); nothing to upload (a save refused, skipped or failed) changes neither
            if uploaded is None:
                self._failed.add(step)
            elif uploaded:
                self._failed.discard(step)
            spent = uploaded is None and self._retried[step] == MAX_RETRIES
        if spent:  # (rank 0: its counts) as the last retry fails, not at a next upload the run may not have
            log.warning(
                "stashpoint: the upload of step %d to %s failed %d more time(s) after the remote tier answered "
                "again; it stays on the local tier, tried no more by this run (a manager opened later tries it)",
                step,
                self.remote.location,
                MAX_RETRIES,
            )
        if self.on_ended is not None:
            self.on_ended()
        kept = None
        with self._lock:
            if not self._pending:
                kept, self._kept = self._kept, None
        del kept  # the last upload ended: a manager dropped meanwhile goes now, outside the lock

    def _retain(self, step: int) -> None:
        """On the uploader thread, once ``step`` is committed remotely: the remote retention."""
        if self.rank != 0 or self.retention is None:
            return
        steps = committed_steps(self.remote, self._known)
        keep = retained(steps, lambda s: self.metrics(s, self.remote), self.retention)
        for s in steps:
            if s not in keep:
                self._known.discard(s)
                delete_step(self.remote, s)
                if self.forget is not None:
                    self.forget(s)

    def _track(self, future: cf.Future[Any]) -> None:
        with self._lock:
            self.futures = [u for u in self.futures if not u.done() or u.exception() is not None]
            self.futures.append(future)

    def pending_futures(self) -> list[cf.Future[Any]]:
        """The uploads queued and not yet ended."""
        with self._lock:
            return [f for f in self.futures if not f.done()]

    def take_ended(self) -> list[cf.Future[Any]]:
        """The uploads ended since the last call, taken (each reported once); the ones still
        running stay, for whoever waits for them."""
        with self._lock:
            out = [f for f in self.futures if f.done()]
            self.futures = [f for f in self.futures if not f.done()]
        return out

    def close(self) -> None:
        self.uploader.shutdown()
