"""The one owner of stashpoint's process-wide state: the save engine and its threads, the writer
process, the gloo groups, the S3 clients, overlap hooks and small caches all live in named slots
here, are created on first use, are dropped in a forked child, and are closed in a fixed order by
:func:`shutdown` (also run at interpreter exit).

Modules keep no mutable globals of their own; they ask for a slot::

    engine = _runtime.slot("save.engine", _Engine, close=_Engine.close, order=10)
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Callable
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
            _atexit_registered = True
        return value


def peek(name: str) -> Any:
    """The object in slot ``name``, or None if it was never made (nothing is created)."""
    return _slots.get(name)


def drop(name: str) -> Any:
    """Empty slot ``name`` without closing what it held; returns that (or None)."""
    with _lock:
        return _slots.pop(name, None)


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
