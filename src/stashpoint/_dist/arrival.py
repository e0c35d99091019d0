"""Who has come to a checkpoint collective: each rank marks its arrival in the job's store, so
that a collective that waits or fails names the ranks that never came, and rank 0 warns long
before the timeout (a rank that never calls save, as in torch.save's ``if rank == 0:`` idiom,
would otherwise show nothing for ten minutes)."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from stashpoint.errors import CheckpointError

log = logging.getLogger("stashpoint")

WAIT_WARN_S = 30.0  # rank 0 names the ranks a collective still waits for after this long
MARK_AFTER_S = 1.0  # a rank marks its arrival once its collective has waited this long


class CollectiveError(CheckpointError):
    """A collective on the checkpoint group failed (a peer died, stalled or left)."""


def store() -> Any:
    """The job's key-value store (the one ``init_process_group`` rendezvoused on), if any."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:
        return None


_CHECK_SPAN = 256  # arrival keys asked about in one request


def absent(store: Any, mark: str | Sequence[str], world: int) -> list[int]:
    """Group ranks that did not mark their arrival at a collective (empty if unknown); with
    several marks, a rank that marked any of them came (the collectives after it: a rank done
    with a rooted one waits in the next). Asks about spans of keys and halves only the spans
    where some are missing: R / 256 requests when all came, about 16 more per rank that did
    not (one per rank was 16,384 requests)."""
    if store is None:
        return []
    marks = [mark] if isinstance(mark, str) else list(mark)
    out: list[int] = []

    def scan(lo: int, hi: int) -> None:
        if any(store.check([f"{m}/{r}" for r in range(lo, hi)]) for m in marks):
            return
        if hi - lo == 1:
            out.append(lo)
            return
        mid = (lo + hi) // 2
        scan(lo, mid)
        scan(mid, hi)

    try:
        for lo in range(0, world, _CHECK_SPAN):
            scan(lo, min(world, lo + _CHECK_SPAN))
    except Exception:
        return []
    return out


class Mark:
    """One rank's arrival at one collective, marked in the store only if the collective waits
    :data:`MARK_AFTER_S`: one that ends sooner asks the store nothing. Marking on entry took two
    store requests per rank per collective, 32,768 a collective at 16,384 ranks, all to one
    server. Whoever looks for the absent (rank 0, after a wait far longer than this or after a
    failure, see :func:`settle`) finds every rank still waiting marked."""

    __slots__ = ("cancelled", "due", "key", "landed", "store", "was_set")

    def __init__(self, store: Any, key: str, due: float) -> None:
        self.store, self.key, self.due = store, key, due
        self.cancelled = False
        self.was_set = False  # the store may hold the key: whoever forgets the mark deletes it
        self.landed = threading.Event()  # the request that sets it has returned

    def now(self) -> None:
        """Mark at once (this rank's collective failed: rank 0 may be about to look)."""
        with _cv:
            if self.was_set:
                return
            self.was_set = True
        self.put()

    def put(self) -> None:
        try:
            with contextlib.suppress(Exception):  # the store failed: the marks only serve messages
                self.store.set(self.key, "1")
        finally:
            self.landed.set()

    def cancel(self) -> None:
        """The collective ended on this rank: no mark is needed any more."""
        with _cv:
            self.cancelled = True

    def forget(self) -> None:
        """Take the mark from the store, if it was ever set (two collectives later)."""
        if self.was_set:
            self.landed.wait(5.0)  # not before the request that sets it (it would stay for good)
            with contextlib.suppress(Exception):
                self.store.delete_key(self.key)


_cv = threading.Condition()
_due: list[tuple[float, int, Mark]] = []
_order = itertools.count()
_marker_pid: int | None = None  # the process whose thread sets the marks (none survives a fork)


def arm(store: Any, key: str) -> Mark:
    """A :class:`Mark` of ``key`` that one thread per process sets in ``store`` unless it is
    cancelled within :data:`MARK_AFTER_S`."""
    global _marker_pid
    mark = Mark(store, key, time.monotonic() + MARK_AFTER_S)
    with _cv:
        if _marker_pid != os.getpid():
            _due.clear()
            threading.Thread(target=_set_due_marks, name="stashpoint-arrivals", daemon=True).start()
            _marker_pid = os.getpid()
        heapq.heappush(_due, (mark.due, next(_order), mark))
        _cv.notify()
    return mark


def _set_due_marks() -> None:
    while True:
        with _cv:
            while _due and _due[0][2].cancelled:
                heapq.heappop(_due)
            if not _due:
                _cv.wait()
                continue
            wait = _due[0][0] - time.monotonic()
            if wait > 0:
                _cv.wait(wait)
                continue
            mark = heapq.heappop(_due)[2]
            mark.was_set = True
        mark.put()


def settle() -> None:
    """Before rank 0 looks for the absent after a failure: the ranks still in the collective
    (or the next) have marked by now, however late they came (their wait passed
    :data:`MARK_AFTER_S`), and those that failed with it marked as they failed."""
    time.sleep(MARK_AFTER_S + 0.5)


def _forked() -> None:  # a fork may copy the lock held by the marker thread, which it does not copy
    global _cv, _marker_pid
    _cv, _marker_pid = threading.Condition(), None
    _due.clear()


os.register_at_fork(after_in_child=_forked)


def ranks_text(ranks: list[int]) -> str:
    """``rank(s) 1, 5, ...``: at most 16 named (a message to a person, at any world size)."""
    more = f" and {len(ranks) - 16} more" if len(ranks) > 16 else ""
    return f"rank(s) {', '.join(map(str, ranks[:16]))}{more}"


def watch(
    what: str, rank: int, world: int, timeout_s: float, *, store: Any, mark: str | Sequence[str]
) -> threading.Timer | None:
    """On the group's first rank, a warning naming the ranks that have not reached ``what``
    once it has waited ``WAIT_WARN_S`` (or half its timeout): a rank that never calls (the
    ``if rank == 0: save(...)`` idiom of torch.save) would otherwise show nothing until the
    timeout, ten minutes by default."""
    if rank != 0 or store is None or world == 1:
        return None
    after = min(WAIT_WARN_S, max(timeout_s / 2, MARK_AFTER_S + 0.5))  # once the waiting ranks marked

    def warn() -> None:
        missing = absent(store, mark, world)
        if missing:
            _wait_warning(after, missing, what, timeout_s)

    timer = threading.Timer(after, warn)
    timer.daemon = True
    timer.start()
    return timer


_GROUP = "create the checkpoint group"
_GROUP_HINT = (
    "every rank of the group must call save and load, in the same order, not only rank 0 (is every rank alive "
    "and saving?)"
)


def all_came(  # noqa: PLR0917
    marks: Any, mark: str, me: int, world: int, timeout_s: float, what: str = _GROUP, hint: str = _GROUP_HINT
) -> None:
    """Before the checkpoint group is created: each rank marks its arrival in the job's store,
    and the first waits for all (polling, warning as :func:`watch` does) so that a rank that
    never comes is named. torch's group creation waits holding the interpreter, where no
    warning could run, and its timeout names a store key, not a rank."""
    try:
        marks.set(f"{mark}/{me}", "1")  # who came (named only when some never do)
        marks.add(f"{mark}/count", 1)  # how many: one small request per poll at any world size
    except Exception:
        return  # no store to mark in: torch's own wait, as before
    if me != 0:
        return
    t0, pause, warned = time.monotonic(), 0.001, False
    try:
        while marks.add(f"{mark}/count", 0) < world:
            waited = time.monotonic() - t0
            if waited >= timeout_s or (not warned and waited >= min(WAIT_WARN_S, timeout_s / 2)):
                missing = absent(marks, mark, world)
                if waited >= timeout_s:
                    said = "create stashpoint's checkpoint group" if what == _GROUP else what
                    raise CollectiveError(
                        f"rank 0: {ranks_text(missing)} did not come to {said} within {timeout_s:.0f} s: {hint}"
                    )
                _wait_warning(waited, missing, what, timeout_s)
                warned = True
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        marks.delete_key(f"{mark}/count")  # every rank came: the count is not needed again
    except CollectiveError:
        with contextlib.suppress(Exception):  # a later try counts its arrivals afresh
            marks.delete_key(f"{mark}/count")
            marks.delete_key(f"{mark}/{me}")
        raise
    except Exception:
        return  # the store failed: torch's own wait, as before


def came(marks: Any, mark: str, me: int) -> None:
    """Once the group exists (every rank came): this rank's arrival mark goes from the store."""
    with contextlib.suppress(Exception):
        marks.delete_key(f"{mark}/{me}")


def _wait_warning(waited: float, missing: list[int], what: str, timeout_s: float) -> None:
    log.warning(
        "stashpoint: rank 0 has waited %.0f s for %s to reach the checkpoint collective '%s' (it fails after %.0f s): "
        "they may be slower (still writing), stuck, or not calling save and load at all; every rank of the group "
        "must call them, in the same order, not only rank 0",
        waited,
        ranks_text(missing),
        what,
        timeout_s,
    )
