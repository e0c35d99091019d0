"""The one owner of stashpoint's process-wide state: the save engine and its threads, the writer
process, the gloo groups, the S3 clients, overlap hooks and small caches all live in named slots
here, are created on first use, are dropped in a forked child, and are closed in a fixed order by
:func:`shutdown` (also run at interpreter exit).

Modules keep no mutable globals of their own; they ask for a slot::

    engine = _runtime.slot("save.engine", _Engine, close=_Engine.close, order=10)
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import gc
import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

log = logging.getLogger("stashpoint")

T = TypeVar("T")

_lock = threading.RLock()
_slots: dict[str, Any] = {}
# name -> (order, close): lower orders close first (saves before the writer process before groups)
_closers: dict[str, tuple[int, Callable[[Any], None]]] = {}
_fork_hooks: dict[str, Callable[[Any], None]] = {}
_atexit_registered = False


def slot(
    name: str,
    factory: Callable[[], T],
    *,
    close: Callable[[T], None] | None = None,
    order: int = 50,
    after_fork: Callable[[T], None] | None = None,
) -> T:
    """The object in slot ``name``, made by ``factory`` on first use. ``close`` (run by
    :func:`shutdown` in ``order``) releases it; ``after_fork`` runs on the copy a forked child
    inherits, before the slot is emptied there (e.g. to close a socket that belongs to the parent)."""
    global _atexit_registered
    value = _slots.get(name)  # the common case, without the lock
    if value is not None:
        return value  # type: ignore[no-any-return]
    with _lock:
        if name in _slots:
            return _slots[name]  # type: ignore[no-any-return]
        value = factory()
        _slots[name] = value
        if close is not None:
            _closers[name] = (order, close)
        if after_fork is not None:
            _fork_hooks[name] = after_fork
        if not _atexit_registered:
            atexit.register(shutdown)
            if not getattr(sys.excepthook, "__stashpoint__", False):
                sys.excepthook = _noting_uncaught(sys.excepthook)
            _atexit_registered = True
        return value


def peek(name: str) -> Any:
    """The object in slot ``name``, or None if it was never made (nothing is created)."""
    return _slots.get(name)


def drop(name: str) -> Any:
    """Empty slot ``name`` without closing what it held; returns that (or None)."""
    with _lock:
        return _slots.pop(name, None)


_uncaught: list[BaseException] = []  # the exception our sys.excepthook saw nothing catch


def _noting_uncaught(previous: Callable[..., Any]) -> Callable[..., Any]:
    """``sys.excepthook`` that notes the exception it is called for, then does what the hook
    before it did."""

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> Any:
        _uncaught[:] = [value]
        return previous(kind, value, tb)

    hook.__stashpoint__ = True  # type: ignore[attr-defined]
    return hook


def exiting_on_error() -> bool:
    """Whether the interpreter is exiting after an exception nothing caught: waiting for peer
    ranks then only delays the job's end (they may be waiting on this one). The interpreter
    sets ``sys.last_value`` when it printed such an exception; so do REPLs and test runners for
    exceptions they handled, so where our hook is still installed the two must agree."""
    last = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if last is None or hasattr(sys, "ps1") or sys.flags.interactive:
        return False
    if getattr(sys.excepthook, "__stashpoint__", False):
        return bool(_uncaught) and _uncaught[0] is last
    return True  # another hook was installed after ours (rich, IPython's)


def submit_or_run(pool: cf.Executor, fn: Callable[..., T], *args: Any) -> cf.Future[T]:
    """``fn(*args)`` on ``pool``, or here and now where the pool takes no more work: the
    interpreter's exit stops every pool before its atexit hooks and the threads the program
    left running end, and work started then (a save, its writes, its upload, its callback, its
    retention) runs on the calling thread. The future holds the result or the error either way."""
    try:
        return pool.submit(fn, *args)
    except RuntimeError:
        pass
    done: cf.Future[T] = cf.Future()
    try:
        done.set_result(fn(*args))
    except Exception as e:  # kept for whoever waits on it, as the pool keeps it
        done.set_exception(e)
    return done


def shutdown() -> None:
    """Wait for this process's saves to finish, stop the writer process, destroy stashpoint's
    gloo groups and drop its clients and caches. Safe to call more than once; stashpoint starts
    afresh when used again. Runs at interpreter exit too."""
    with _lock:
        held = [(order, name) for name, (order, _) in _closers.items() if name in _slots]
        held.sort()
    for _, name in held:
        with _lock:
            value = _slots.pop(name, None)
            _, close = _closers[name]
        if value is None:
            continue
        try:
            close(value)
        except Exception as e:  # one resource failing to close must not keep the others open
            log.warning("stashpoint: shutting down %s failed: %s: %s", name, type(e).__name__, e)
    with _lock:
        _slots.clear()


class _GcPause:
    """Nested pauses of Python's cyclic garbage collector, from any thread: the first one in
    disables it (if it was enabled), the last one out enables it again."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.was_enabled = False

    def resume_in_child(self) -> None:  # a fork during a pause: the child collects as before
        if self.depth and self.was_enabled:
            gc.enable()


@contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic cyclic garbage collection while the block runs. A load or a save's call
    allocates many small objects (parsed indexes, plans); in a process whose heap holds millions
    of objects (a model's code, a dataset's) those allocations set off full collections that
    cost as much as the load itself (0.17 s at 300,000 objects). What the block leaves behind is
    collected afterwards as usual."""
    pause = slot("gc.pause", _GcPause, after_fork=_GcPause.resume_in_child)
    with pause.lock:
        if pause.depth == 0:
            pause.was_enabled = gc.isenabled()
            gc.disable()
        pause.depth += 1
    try:
        yield
    finally:
        with pause.lock:
            pause.depth -= 1
            if pause.depth == 0 and pause.was_enabled:
                gc.enable()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.RLock()
    for name, hook in list(_fork_hooks.items()):
        value = _slots.get(name)
        if value is not None:
            try:
                hook(value)
            except Exception as e:
                log.debug("stashpoint: after fork, %s: %s", name, e)
    _slots.clear()  # threads, sockets and groups belong to the parent


os.register_at_fork(after_in_child=_after_fork_in_child)


_SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def drop_locals(error: BaseException, keep: BaseException | None = None) -> None:
    """Clear the local variables of the finished frames in ``error``'s traceback and those of
    the errors it chains (plans, buffers, tensors made for a load or a save); the lines stay
    for the report. ``keep`` (an error raised to a caller too) and what it chains keep theirs,
    for its debugger; a suspended generator's frame is left alone (clearing it closes it)."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and e is not keep and id(e) not in seen:
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            if not tb.tb_frame.f_code.co_flags & _SUSPENDABLE:
                try:
                    tb.tb_frame.clear()
                except RuntimeError:  # still running (the caller's own frame)
                    pass
            tb = tb.tb_next
        e = e.__cause__ or e.__context__
