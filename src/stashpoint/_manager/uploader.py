"""The uploader: copies committed steps from the local tier to the remote one in the background,
one at a time and in the order they were saved, on a thread of its own with a checkpoint process
group of its own (so uploads never share a group with saves, nor with another manager's
uploads). In a distributed run every rank uploads the shard files it wrote; once all of them
are in place, rank 0 writes the remote manifest last: the remote copy commits exactly as a save
does, and a crash mid-upload leaves only a leftover that the next manager removes.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from stashpoint import _runtime
from stashpoint._core.naming import MANIFEST_NAME, step_dir
from stashpoint._core.nodeplan import expand, ranges, upload_parts
from stashpoint._dist import group as _dist
from stashpoint._dist.arrival import CollectiveError
from stashpoint._dist.commit import Outcome, RankFailure, finish_together
from stashpoint._dist.group import DistContext
from stashpoint._load.manifest import read_head
from stashpoint._manager.holdings import held_ranks
from stashpoint._manager.rewindmark import Rewind, clear_rewind, mark_rewind
from stashpoint._manager.steps import committed_steps, move_aside
from stashpoint._manager.upload import UploadStart, copy_file, decide, own_files
from stashpoint._storage import Storage
from stashpoint.errors import CheckpointError, ReplicaError

log = logging.getLogger("stashpoint")

#: Collectives of an upload wait for the slowest rank's copy: far longer than a save's steps.
UPLOAD_TIMEOUT_S = 3600.0
_slots: set[int] = set()  # the upload groups' numbers held by open managers
_slots_lock = threading.Lock()


def _take_slot() -> int:
    """The lowest upload-group number no open manager holds: alike on every rank, which open and
    close their managers in the same order; a closed manager's group serves the next one."""
    with _slots_lock:
        n = next(i for i in itertools.count() if i not in _slots)
        _slots.add(n)
        return n


def _commit_copy(src: Storage, dst: Storage, outcomes: Sequence[Outcome]) -> int:
    """Rank 0, once every rank copied its files: commit the remote copy (its manifest, last),
    once one listing shows every file the ranks copied there, at its size. An object store has
    no lock: a manager opened elsewhere on this remote tier takes an upload in flight for a
    crash's leftover and deletes it, and the manifest would then commit a step of no files."""
    copied = {name: size for o in outcomes for name, size in o.payload or ()}
    gone = _not_there(dst, copied)
    if gone:  # asked once more: a store whose listing lags behind its writes
        time.sleep(1.0)
        gone = _not_there(dst, copied)
    if gone:
        shown = ", ".join(gone[:3]) + (f" and {len(gone) - 3} more" if len(gone) > 3 else "")
        raise CheckpointError(
            f"{len(gone)} of the {len(copied)} file(s) copied to {dst.location} were deleted or changed before "
            f"the copy committed ({shown}): did a CheckpointManager opened elsewhere on this remote_root (an "
            "evaluation job, another run) remove them as a crash's leftover? Open one manager per remote_root; "
            "read the remote tier with stashpoint.read or stashpoint.load instead"
        )
    dst.commit(MANIFEST_NAME, src.read(MANIFEST_NAME))
    return sum(o.nbytes for o in outcomes)


def _remove_uncommitted(dst: Storage) -> None:
    """A remote copy whose upload failed: removed, unless its manifest made it (then it is whole).
    A failure here is logged: the upload's own error is the one to raise."""
    try:
        plain = dst.best_effort()
        if not plain.exists(MANIFEST_NAME):
            plain.remove_tree()
    except (OSError, CheckpointError) as e:
        log.warning("stashpoint: removing the failed copy at %s failed: %s", dst.location, e)


def _not_there(dst: Storage, copied: dict[str, int]) -> list[str]:
    """The names of ``copied`` (name: size) one listing of ``dst`` lacks, or shows at another size."""
    there = dst.sizes() if copied else {}
    return sorted(name for name, size in copied.items() if there.get(name) != size)


class Uploader:
    """Copies steps from ``local`` to ``remote`` (two run roots) in the background, in order.

    Create it on every rank at the same point (it creates a process group in a distributed run);
    submit the same steps on every rank in the same order. ``on_result(step, uploaded)`` is
    called on the uploader thread after each step: True once its remote copy committed, False
    when there was nothing to upload (the save failed or was skipped), None when the upload
    failed (the step is uploaded again after a later upload commits, or by a manager opened later).
    """

    def __init__(
        self,
        local: Storage,
        remote: Storage,
        *,
        on_result: Callable[[int, bool | None], None] | None = None,
        on_committed: Callable[[int], None] | None = None,
        node_local: bool = False,
        retry: Callable[[], tuple[list[int], list[int]]] | None = None,
        on_dropped: Callable[[list[int]], None] | None = None,
        on_retrying: Callable[[list[int]], None] | None = None,
    ) -> None:
        self.local = local
        self.remote = remote
        self.node_local = node_local  # ``local`` is this node's own root: each rank copies what its node holds
        self.on_result = on_result
        self.on_committed = on_committed
        # (rank 0) the failed steps to upload again once an upload commits, and those to give up
        # on (the remote retention would not keep them); sent with that upload's decision
        self.retry = retry
        self.on_dropped = on_dropped
        self.on_retrying = on_retrying  # (rank 0) the retries ``retry`` listed are starting
        self._again: tuple[list[int], list[int]] = ([], [])
        self._retrying = False
        self._slot = _take_slot()
        self._purpose = f"upload-{self._slot}"  # a group of its own: two managers' uploads never interleave
        self._ctx = _dist.context(None, UPLOAD_TIMEOUT_S, purpose=self._purpose) or DistContext.solo()
        self._executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="stashpoint-upload")
        self._broken: CollectiveError | None = None
        self._seq = 0
        # (rank 0) a rewind's remote steps, moved aside by the first upload from this sequence
        # number on that can; its mark in the local root goes then (rewindmark)
        self.rewind: tuple[Rewind, int] | None = None
        self._rewind_lock = threading.Lock()
        self._stale_mark = False  # applied, but its file could not be removed: tried again
        # (rank 0) the last upload failed: the next asks the remote tier first, within its short
        # limits, and fails at once if it does not answer (each queued step would wait out the
        # whole retry budget and timeout of a server that is down or stalled: minutes at close())
        self._suspect = False
        # (rank 0) a preempted job's newest step committed: the queued uploads of older steps
        # wait for the next manager of the root, so that the process ends with that step uploaded
        self.superseded_below: int | None = None

    def submit(self, step: int, after: cf.Future[Any] | None = None) -> cf.Future[bool]:
        """Upload ``step`` once ``after`` (its local save) has succeeded; the future tells whether
        a copy was made (False: the save failed or was skipped, so there was nothing to upload)."""
        self._seq += 1
        return _runtime.submit_or_run(self._executor, self._one, step, after, self._seq)

    def note_rewind(self, mark: Rewind, *, since: int | None = None, write: bool = True) -> None:
        """(Rank 0) a save went back to step ``mark.above`` without moving the remote tier's
        steps above it aside (it could not list them): the next upload (or ``since``, a sequence
        number) and every later one move them before copying anything, until one has. Written
        down in the local root meanwhile (not a node-local one: rank 0 may come back on another
        node), for a restore to pass them by and a later manager to move them."""
        with self._rewind_lock:
            first = self._seq + 1 if since is None else since
            if self.rewind is not None:  # one still pending: the two together (no new step went up since)
                old, seq = self.rewind
                mark, first = Rewind(min(mark.above, old.above), mark.remote, max(mark.at, old.at)), min(first, seq)
            if write and not self.node_local:
                try:
                    mark_rewind(self.local, mark)
                except (OSError, CheckpointError) as e:
                    log.warning("stashpoint: could not write the rewind down in %s (%s)", self.local.location, e)
            self.rewind = (mark, first)

    def catch_up(self, todo: list[int]) -> cf.Future[list[int]]:
        """Upload the steps in ``todo``, the same list on every rank (rank 0's, sent at open):
        those a crash or a failed upload left behind."""
        self._seq += 1
        return _runtime.submit_or_run(self._executor, self._catch_up, todo, self._seq)

    @property
    def ctx(self) -> DistContext:
        """The upload group's context; after ``stashpoint.shutdown()`` destroyed the group, a
        fresh one, made by every rank at its next upload (they upload in step)."""
        if self._ctx.closed:
            self._ctx = _dist.context(None, UPLOAD_TIMEOUT_S, purpose=self._purpose) or DistContext.solo()
        return self._ctx

    def shutdown(self) -> None:
        try:
            self._executor.shutdown(wait=True)
        finally:
            with _slots_lock:
                _slots.discard(self._slot)

    def _catch_up(self, todo: list[int], seq: int, *, retries: bool = False) -> list[int]:
        """Upload ``todo`` in turn. ``retries`` (failed uploads tried again): each is counted as
        it starts, and the first that fails leaves the rest for the next upload that commits (the
        remote tier fails again: each would wait out its own timeout, and close() all of them)."""
        done = []
        for i, s in enumerate(todo):
            if retries and self.on_retrying is not None:
                try:
                    self.on_retrying([s])
                except Exception:  # bookkeeping: the retries go on alike on every rank
                    log.exception("stashpoint: counting the retry of step %d failed", s)
            try:
                if self._one(s, None, seq):
                    done.append(s)
            except CheckpointError as e:  # raised on every rank alike: the outcome is shared
                log.error("stashpoint: %s", e)
                if retries and todo[i + 1 :]:
                    log.warning(
                        "stashpoint: the upload of step(s) %s waits for the next upload that commits", todo[i + 1 :]
                    )
                    break
        return done

    def _one(self, step: int, after: cf.Future[Any] | None, seq: int) -> bool:
        uploaded: bool | None = None
        try:
            uploaded = self._upload(step, after, seq)
            if uploaded and not self._retrying:
                self._upload_again(seq)
            return bool(uploaded)
        except BaseException:
            self._suspect = self.ctx.rank == 0
            raise
        finally:
            if self.on_result is not None:
                try:
                    self.on_result(step, uploaded)
                except Exception:
                    log.exception("stashpoint: bookkeeping after the upload of step %d failed", step)

    def _upload_again(self, seq: int) -> None:
        """After an upload committed (the remote tier answers again): the steps whose uploads
        failed before, as rank 0 listed them with its decision (every rank alike, in step)."""
        (todo, dropped), self._again = self._again, ([], [])
        if dropped and self.on_dropped is not None:  # the remote retention would delete them at once
            try:
                self.on_dropped(dropped)
            except Exception:  # bookkeeping: the retries below go on alike on every rank
                log.exception("stashpoint: letting go of the failed uploads of step(s) %s failed", dropped)
        if not todo:
            return
        log.info("stashpoint: the remote tier %s answers again: uploading step(s) %s", self.remote.location, todo)
        self._retrying = True
        try:
            self._catch_up(todo, seq, retries=True)
        finally:
            self._retrying = False

    def _to_retry(self) -> tuple[list[int], list[int]]:
        """(Rank 0) the failed steps to upload after this upload, and those given up on; none
        while retrying, or once a preempted job's last step goes first (it ends soon)."""
        if self.retry is None or self._retrying or self.superseded_below is not None:
            return [], []
        try:  # never raised before the broadcast: the other ranks wait in it
            return self.retry()
        except Exception:
            log.exception("stashpoint: listing the failed uploads to retry failed")
            return [], []

    def _upload(self, step: int, after: cf.Future[Any] | None, seq: int) -> bool | None:
        """Whether ``step`` was uploaded (False: nothing to upload; None: left for later)."""
        if self._broken is not None:
            raise CheckpointError(
                f"step {step} was not uploaded: the ranks lost each other in an earlier upload ({self._broken}); "
                "it is uploaded when a manager opens this root again"
            )
        ctx = self.ctx
        src = self.local.child(step_dir(step))
        dst = self.remote.child(step_dir(step))
        t0 = time.perf_counter()
        # 1. agree that there is something to upload (every rank saw its save succeed); rank 0
        # alone sees every rank's view and answers each with the decision
        kind, detail = self._start_status(step, after, src, dst, seq)
        held = _held(src) if self.node_local else None
        starts: list[UploadStart] | None = self._collective(
            self.ctx.gather, "upload start", UploadStart(seq, step, kind, detail, held)
        )
        decision = decide(starts) if starts is not None else None
        parts = None  # node-local: the saved ranks each rank copies, from what its node holds
        if starts is not None and decision is not None and decision[0] == "ok" and self.node_local:
            parts, missing = upload_parts(decision[1], [u.held or () for u in starts])
            if missing:
                shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
                decision = ("error", f"no node holds the files of saved rank(s) {shown} whole")
        again = self._to_retry() if decision is not None and decision[0] == "ok" else ([], [])
        told = self._broadcast("upload decision", None if decision is None else (*decision, again))
        kind, detail, self._again = told
        if kind == "broken":
            self._broken = CollectiveError(detail)
            raise CheckpointError(f"uploading step {step} failed: {self._broken}")
        if kind == "skip":
            return False
        if kind == "later":
            log.warning(
                "stashpoint: step %d is uploaded when a manager opens %s again: %s", step, self.local.location, detail
            )
            return None
        if kind == "done":
            return True
        if kind == "error":
            raise CheckpointError(f"uploading step {step} to {dst.location} failed: {detail}")
        # 2. every rank copies the files it wrote; 3. rank 0 commits the remote copy (manifest last)
        saved = expand(self._collective(ctx.scatter, "upload parts", parts)) if self.node_local else None
        outcome, local = Outcome(), None
        try:
            dst.prepare()
            nbytes, copied = 0, []
            for up in own_files(src, ctx.rank, ctx.world, saved):
                copy_file(src, dst, up)
                nbytes += up.size
                copied.append((up.name, up.size))
            dst.sync()
            outcome = Outcome(payload=tuple(copied), nbytes=nbytes)
        except Exception as e:
            outcome, local = Outcome(error=f"{type(e).__name__}: {e}"), e
        try:
            total = self._collective(
                lambda what, mine: finish_together(ctx, what, mine, lambda done: _commit_copy(src, dst, done), local),
                "upload",
                outcome,
            )
        except RankFailure as e:
            if ctx.rank == 0:
                _remove_uncommitted(dst)  # every rank is done with it
            raise CheckpointError(
                f"uploading step {step} to {dst.location} failed: {e}. The local copy at {src.location} is "
                "kept; the step is uploaded again after the next upload that commits, or by a manager opened later."
            ) from e.local
        log.info(
            "stashpoint: uploaded step %d to %s (%.1f MB in %.2f s)",
            step,
            dst.location,
            total / 1e6,
            time.perf_counter() - t0,
        )
        if self.on_committed is not None:
            try:
                self.on_committed(step)
            except Exception:  # the copy is committed: a failing retention must not say otherwise
                log.exception("stashpoint: the remote retention after step %d failed", step)
        return True

    def _start_status(
        self, step: int, after: cf.Future[Any] | None, src: Storage, dst: Storage, seq: int
    ) -> tuple[str, Any]:
        """This rank's view: ("skip", why), ("done", None), ("ok", the saved world size; None
        but on rank 0) or ("error", why)."""
        if after is not None:
            error = None if after.cancelled() else after.exception()
            if after.cancelled() or (error is not None and not isinstance(error, ReplicaError)):
                return ("skip", "the save failed")
            if error is None and getattr(after.result(), "skipped", False):
                return ("skip", "the save was skipped")
        if self.ctx.rank != 0:
            return ("ok", None)
        if self.superseded_below is not None and step < self.superseded_below:
            return ("later", f"the job was preempted, and step {self.superseded_below} goes up first")
        if self._suspect:
            try:
                self.remote.best_effort().exists(None)
            except OSError as e:
                return ("error", f"the remote tier does not answer ({e}); the last upload failed too")
            self._suspect = False
        try:
            head = read_head(src)
            if (rewind := self.rewind) is not None and seq >= rewind[1]:
                for s in committed_steps(self.remote):
                    if rewind[0].abandoned(self.remote, s, self.local) and not move_aside(self.remote, s, "rewound"):
                        return ("error", f"step {s} of the run abandoned by a rewind could not be moved aside")
                with self._rewind_lock:  # not if a newer rewind came meanwhile
                    if self.rewind == rewind:
                        self.rewind = None
                        self._stale_mark = not self.node_local
            with self._rewind_lock:
                if self._stale_mark and self.rewind is None:
                    self._stale_mark = not clear_rewind(self.local)
            if dst.exists(MANIFEST_NAME):
                if read_head(dst).save_id == head.save_id:
                    return ("done", None)
                # another run's save of this step number (a new run in an old root): kept aside
                # like a rewound one, never deleted before this copy is checked and committed
                if not move_aside(self.remote, step, "rewound"):
                    return ("error", f"another run's step {step} there could not be moved aside")
            return ("ok", head.world_size)
        except Exception as e:
            return ("error", f"{type(e).__name__}: {e}")

    def _broadcast(self, what: str, obj: Any) -> Any:
        return self._collective(self.ctx.broadcast, what, obj)

    def _collective(self, fn: Callable[[str, Any], Any], what: str, obj: Any) -> Any:
        """A collective on the upload group; once one fails, the group is dropped for good."""
        try:
            return fn(what, obj)
        except CollectiveError as e:
            self._broken = e
            _dist.forget(self._ctx)
            raise


def _held(src: Storage) -> tuple[tuple[int, int], ...]:
    """The saved ranks whose files of the step at ``src`` (a node's directory) it holds whole;
    none where that cannot be told (the upload then finds who else holds them)."""
    try:
        return ranges(held_ranks(src, read_head(src).save_id)[0])
    except (OSError, CheckpointError):
        return ()
