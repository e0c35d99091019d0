"""A manager's ``on_save`` callback: called on a thread of its own, in the order the saves
ended, with the steps it has yet to be called for kept from the retention meanwhile; and a
manager never closed, whose saves and callbacks end before the interpreter's thread pools stop."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import concurrent.futures.thread  # noqa: F401  (its exit hook registered first: ours runs before it)
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stashpoint import _runtime
from stashpoint._core.policy import Doubling
from stashpoint._manager import retention
from stashpoint.errors import CheckpointError

if TYPE_CHECKING:
    from stashpoint._manager.manager import CheckpointManager
    from stashpoint._save.handle import SaveStats

log = logging.getLogger("stashpoint")


ON_SAVE_THREAD = "stashpoint-on-save"  # the prefix of the callback thread's name


def call_on_save(
    mgr: CheckpointManager, on_save: Callable[[SaveStats], None], step: int, stats: SaveStats, after: cf.Future[None]
) -> None:
    """``on_save(stats)`` on the manager's callback thread, then ``after`` set: not on the
    writer thread, where a callback that saves (an export of each step) queued its save behind
    itself and waited for ever, nor on the retention's, which a slow callback held back (the
    disk kept every step saved meanwhile). At interpreter exit (no new thread) it runs here."""

    def call() -> None:
        _calling.manager = mgr
        try:
            on_save(stats)
        except Exception:
            log.exception("stashpoint: the on_save callback raised")
        except BaseException as e:  # sys.exit() in it ends no program from this thread: said, not lost
            log.error("stashpoint: the on_save callback for step %d raised %s; it was stopped", step, type(e).__name__)
            if not threading.current_thread().name.startswith(ON_SAVE_THREAD):  # called inline (at exit): it goes on
                raise
        finally:
            _calling.manager = None
            try:
                if not stats.skipped and mgr._owner and mgr._awaiting.done(step):
                    with mgr._lock:  # the step it kept may go now
                        if not mgr._closed:
                            retention.retain_later(mgr)
            finally:
                after.set_result(None)

    _runtime.submit_or_run(mgr._callbacks, call)


#: Steps waiting for their ``on_save`` call above which the manager warns (again at each doubling).
CALLBACK_BACKLOG_WARNING = 2


class Awaiting:
    """The committed steps whose ``on_save`` call has not ended: the retention keeps them (an
    export in the callback reads its step). A callback slower than the saves keeps more and
    more of them: said as the count passes the mark and each time it doubles."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # its own: the retention reads it with the manager's lock held
        self._steps: collections.Counter[int] = collections.Counter()
        self._backlog = Doubling(CALLBACK_BACKLOG_WARNING)

    def add(self, step: int, where: str) -> None:
        with self._lock:
            self._steps[step] += 1
            count = len(self._steps)
            louder = self._backlog.louder(count)
        if louder:
            log.warning(
                "stashpoint: %d steps in %s wait for the on_save callback, which takes longer than the time "
                "between saves; each is kept on disk until it has been called for it (make the callback "
                "faster, or save less often)",
                count,
                where,
            )

    def done(self, step: int) -> bool:
        """The call for ``step`` ended; whether it kept a step (the retention may act now)."""
        with self._lock:
            if self._steps[step] <= 0:
                self._steps.pop(step, None)
                return False
            self._steps[step] -= 1
            if self._steps[step] <= 0:
                del self._steps[step]
            return True

    def steps(self) -> set[int]:
        with self._lock:
            return set(self._steps)


#: The manager whose ``on_save`` callback this thread runs, if any.
_calling = threading.local()


def refuse_on_own_thread(mgr: CheckpointManager, what: str) -> None:
    """Refuse ``mgr.wait()`` / ``mgr.close()`` from ``mgr``'s own ``on_save`` callback: they
    wait for the manager's thread, which runs the callback, and would wait for ever."""
    if getattr(_calling, "manager", None) is mgr:
        raise CheckpointError(
            f"CheckpointManager.{what}() was called from the manager's own on_save callback, which runs on the "
            f"manager's thread that {what}() waits for; call it from the training loop instead (e.g. set a flag "
            "in the callback and check it there)"
        )


def settle(mgr: CheckpointManager, *, say_after: float | None = None) -> None:
    """Wait until ``mgr`` has no save, upload, deletion or callback pending, those started
    meanwhile too; its failures stay for its ``wait()`` (the interpreter's exit settles a
    manager never closed, while a thread of the program may still call it). ``say_after``: log
    what it waits for once that many seconds have passed (a program that seems to hang at exit)."""
    if mgr._nodes is not None:
        mgr._nodes.settled()
    start = time.monotonic()
    while True:
        pending = unfinished(mgr)
        if not pending:
            break
        left = None if say_after is None else start + say_after - time.monotonic()
        if left is None or left > 0:
            cf.wait(pending, timeout=left)
            continue
        log.warning(
            "stashpoint: the program is ending and waits for %d save(s), upload(s) or on_save call(s) of the "
            "CheckpointManager on %s (close() it before the program ends to wait there instead)",
            len(pending),
            mgr.root,
        )
        say_after = None


def unfinished(mgr: CheckpointManager, *, locks: bool = True) -> list[cf.Future[Any]]:
    """``mgr``'s saves, uploads, deletions and callbacks not ended yet. ``locks=False`` (a
    forked child): read without the locks, a future's own included, that a thread of the
    parent may have held at the fork (each list is copied whole, as the GIL allows)."""
    pending = [a for _, a in list(mgr._handles)] + list(mgr._refused) + list(mgr._deletions)
    pending += list(mgr._tier.futures) if mgr._tier is not None else []
    if locks:
        return [f for f in pending if not f.done()]
    return [f for f in pending if f._state not in ("FINISHED", "CANCELLED_AND_NOTIFIED")]


_open: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()


def track(mgr: CheckpointManager) -> None:
    """Have ``mgr``'s saves and callbacks end at interpreter exit if it is never closed."""
    _open.add(mgr)


def _drain_at_exit() -> None:
    """At interpreter exit, before ``concurrent.futures`` stops its pools taking work (its hook,
    registered before this one, runs after it): the saves, uploads and ``on_save`` calls of
    managers never closed end as they would have. Otherwise a callback left to run then ran on
    the writer thread, out of order, and one that saves waited there for that thread for ever.
    Failures are not taken: a thread of the program still running may ``close()`` the manager."""
    for mgr in list(_open):
        if not mgr._closed:
            try:
                settle(mgr, say_after=30.0)
            except KeyboardInterrupt:  # Ctrl-C: stop waiting, let the other exit hooks run
                log.warning(
                    "stashpoint: stopped waiting for the CheckpointManager on %s; Python still waits for the threads "
                    "running its work (a save, an upload, an on_save call): press Ctrl-C again to end the program "
                    "now (a save cut short is cleaned up at the next start)",
                    mgr.root,
                )
                return
            except Exception:  # the program is ending: said, not raised
                log.exception("stashpoint: at exit, waiting for the manager on %s failed", mgr.root)


try:
    threading._register_atexit(_drain_at_exit)  # type: ignore[attr-defined]
except RuntimeError:  # first imported from an atexit hook: the pools are stopped, the work runs inline
    pass
# a forked child (a DataLoader worker) has none of the parent's threads to wait for
os.register_at_fork(after_in_child=_open.clear)
