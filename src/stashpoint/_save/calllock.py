"""The lock around a save's call that a signal handler's save cannot wait on for ever."""

from __future__ import annotations

import threading
from types import TracebackType

from stashpoint.errors import CheckpointError


class CallLock:
    """A lock refusing the thread that holds it, instead of waiting for itself: a save started
    from a signal handler runs on the thread whose save the signal interrupted, inside its
    call (a SIGTERM handler saving while the training loop's save stages)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # knows its owner at C level: a Ctrl-C cannot leave it unknown
        self._inside = False  # the owner is inside a call (set once it holds the lock)
        self._local = threading.local()  # .entering: this thread is between its acquire and _inside

    def __enter__(self) -> None:
        if self._lock._is_owned():  # type: ignore[attr-defined]
            if self._inside or getattr(self._local, "entering", False):
                raise CheckpointError(
                    "a save was started while another save's call was running on the same thread (from a signal "
                    "handler, which runs inside the call it interrupts), where it would wait for that call for "
                    "ever; set a flag in the handler and save from the training loop, or use "
                    "CheckpointManager(preemption_deadline=...), which saves at the next maybe_save"
                )
            self._inside = True  # held since a Ctrl-C came before an __exit__'s release: ours again
            return
        self._local.entering = True
        try:
            self._lock.acquire()
            self._inside = True
        except BaseException:  # a Ctrl-C right after the acquire: let go of it
            if self._lock._is_owned() and not self._inside:  # type: ignore[attr-defined]
                self._lock.release()
            raise
        finally:
            self._local.entering = False

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self._inside = False
        self._lock.release()
