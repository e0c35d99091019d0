"""The descriptors of checkpoint files this process has open for a save or a load, closed in a
child forked meanwhile (a DataLoader worker): it would hold them open as long as it lives, and
with them the disk space of a step the retention deletes."""

from __future__ import annotations

import os
import threading

_open: set[int] = set()
_lock = threading.Lock()


def track(*fds: int | None) -> None:
    """Note descriptors just opened (after the open: one opened meanwhile stays in a child)."""
    with _lock:
        _open.update(fd for fd in fds if fd is not None and fd >= 0)


def forget(*fds: int) -> None:
    """Before closing: a number closed and reused by another file must never be closed here."""
    with _lock:
        _open.difference_update(fds)


def close(fd: int) -> None:
    forget(fd)
    os.close(fd)


def _close_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    for fd in _open:
        try:
            os.close(fd)
        except OSError:
            pass
    _open.clear()


os.register_at_fork(after_in_child=_close_in_child)
