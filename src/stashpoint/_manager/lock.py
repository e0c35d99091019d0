"""The lock that makes one CheckpointManager the owner of its root (a ``flock``, released by the
kernel when its process dies)."""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from stashpoint._core.naming import LOCK_NAME
from stashpoint.errors import CheckpointError


def acquire_root_lock(root: Path) -> int:
    """The open, locked lock file of ``root``; raises if another manager owns the root."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:  # never through a planted symbolic link (it could create a file outside the root)
        fd = os.open(root / LOCK_NAME, flags, 0o644)
    except OSError as e:
        raise CheckpointError(
            f"cannot open the manager's lock file {root / LOCK_NAME} ({e.strerror or e}); it must be a regular file "
            "(remove whatever is there)"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"the manager's lock file {root / LOCK_NAME} is not a regular file; remove it")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CheckpointError(
            f"another CheckpointManager (in this or another process) already owns {root}; close it first, "
            "or give each run its own directory."
        ) from None
    return fd
