"""The lock that makes one CheckpointManager the owner of its root (a ``flock``, released by the
kernel when its process dies), and the check that every rank shares that root."""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import stat
import threading
import weakref
from pathlib import Path
from typing import Any

from stashpoint._core.naming import LOCK_NAME
from stashpoint.errors import CheckpointError


def acquire_root_lock(root: Path) -> int:
    """The open, locked lock file of ``root``; raises if another manager owns the root."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:  # never through a planted symbolic link (it could create a file outside the root)
        fd = os.open(root / LOCK_NAME, flags, 0o644)
    except OSError as e:
        if e.errno in (errno.EROFS, errno.EACCES):
            raise CheckpointError(
                f"cannot open or create the manager's lock file in {root} ({e.strerror}): a CheckpointManager "
                "saves, so its root must be writable. To read checkpoints there, use stashpoint.load or "
                "stashpoint.read on a step directory, or `stashpoint ls` / `stashpoint verify`"
            ) from None
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
        linked = os.fstat(fd).st_nlink > 1
        os.close(fd)
        from stashpoint._save.engine import unjoined_hint, unjoined_launch

        if linked:  # one inode, two roots: the lock is held through the other name
            raise CheckpointError(
                f"the manager's lock file {root / LOCK_NAME} is a hard link to another directory's (a copy made "
                "with `cp -al`, say), whose manager holds it; remove this copy's lock file, which a manager opening "
                f"{root} creates anew"
            ) from None

        if unjoined_launch():
            raise CheckpointError(f"another CheckpointManager already owns {root}: {unjoined_hint()}") from None
        raise CheckpointError(
            f"another CheckpointManager (in this or another process) already owns {root}; close it first "
            "(mgr.close(), or a `with` block; a manager dropped without close() holds it until its saves, uploads and "
            "callbacks end and it is collected, and in a notebook, which may still refer to it, until the kernel "
            "restarts), or give each run its own directory. To only read a step, stashpoint.load its step "
            "directory."
        ) from None
    except OSError as e:  # ENOLCK (NFS without lockd), ENOSYS/EOPNOTSUPP (Lustre without flock, FUSE)
        os.close(fd)
        raise CheckpointError(
            f"the file system of {root} cannot lock the manager's lock file {LOCK_NAME} ({e.strerror or e}); "
            "mount it with locking (NFS: lockd; Lustre: -o flock), or use a root on another file system"
        ) from None
    with _held_lock:
        _held.add(fd)
    return fd


class Holding:
    """What an open manager holds in the process: its root's lock (``root``, where it owns a
    local root), released too if the manager is collected without ``close()`` (a notebook's
    cell run again), and the idle staging buffers its saves keep between saves."""

    def __init__(self, owner: object, root: Path | None, saves: int) -> None:
        from stashpoint._save import staging

        self._owner = weakref.ref(owner)
        self.fd = -1 if root is None else acquire_root_lock(root)
        self._unlock = None if root is None else weakref.finalize(owner, release_root_lock, self.fd)
        staging.reserve(owner, saves)

    def release(self) -> None:
        from stashpoint._save import staging
        from stashpoint._save.engine import current_engine

        owner = self._owner()
        keep = staging.unreserve(owner) if owner is not None else staging.reserved()
        engine = current_engine()
        if engine is not None:  # the idle staging buffers beyond what the managers left keep go now
            engine.pool.keep_at_most(keep)
        if self._unlock is not None:
            self._unlock.detach()  # never later: its number may be another manager's lock by then
        if self.fd >= 0:
            release_root_lock(self.fd)
            self.fd = -1


def release_root_lock(fd: int) -> None:
    """Close the lock file ``acquire_root_lock`` opened, which releases the root (in a forked
    child, where the fork closed it already, nothing)."""
    with _held_lock:
        if fd not in _held:
            return
        _held.discard(fd)
    os.close(fd)


# A flock belongs to the open file, which a fork shares: a child forked while a manager is open
# (a DataLoader worker) would keep the root locked after the manager closed, or its process died.
_held: set[int] = set()
_held_lock = threading.Lock()


def _drop_in_child() -> None:
    global _held_lock
    _held_lock = threading.Lock()  # another thread may have held it at the fork
    for fd in _held:
        try:
            os.close(fd)  # never LOCK_UN: that would unlock the parent's root too
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_drop_in_child)


def check_shared_root(root: Path, process_group: Any = None, timeout: float | None = None) -> None:
    """Check that every rank of a save's group sees the run directory rank 0 writes to: a
    manager without ``node_local`` keeps all ranks' files of a step in one directory, and a root
    on each node's own disk gave checkpoints committed by rank 0 that no restart could load.
    One empty file and three small collectives (every rank calls it, at its first save)."""
    from stashpoint._dist import group as _dist
    from stashpoint._save.engine import wait_all

    wait_all()  # the checkpoint group is used by one thread at a time: saves in flight first
    ctx = _dist.context(process_group, timeout)
    if ctx is None:
        return
    name = None
    if ctx.rank == 0:
        name = f".stashpoint-shared-{secrets.token_hex(8)}"
        try:
            (root / name).write_bytes(b"")
        except OSError:
            name = None  # the save that follows fails on it, with the cause
    name = ctx.broadcast("manager: the shared root's probe", name)
    # each rank's root goes to rank 0 alone: of the ranks that miss the probe, it names those whose
    # root differs from its own (a shared file system mounted elsewhere on a node is no mistake)
    seen = ctx.gather("manager: the probe seen", (name is None or (root / name).is_file(), str(root)))
    missing: list[int] | None = None
    other: list[tuple[int, str]] = []
    if seen is not None:
        missing = [r for r, (ok, _) in enumerate(seen) if not ok]
        other = [(r, where) for r, (ok, where) in enumerate(seen) if not ok and where != str(root)][:8]
        other = [(0, str(root)), *other] if other else []
        if name is not None:
            (root / name).unlink(missing_ok=True)
    missing, other = ctx.broadcast("manager: ranks that do not share the root", (missing, other))
    if missing:
        shown = ", ".join(str(r) for r in missing[:16]) + (", ..." if len(missing) > 16 else "")
        roots = ", ".join(f"rank {r}: {where}" for r, where in other)
        differ = f"the ranks gave their CheckpointManager different roots ({roots}): " if other else ""
        raise CheckpointError(
            f"rank(s) {shown} do not see the files rank 0 writes in {root}: {differ}a CheckpointManager keeps "
            "every rank's files of a step in one directory, so every rank must give the same root, on a file "
            "system every node shares. For a directory on each node's own disk, pass node_local=True; or use a "
            "shared path or an s3:// root"
        )
