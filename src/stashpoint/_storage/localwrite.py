"""Writing one local file durably: in order, with direct I/O where the file system allows it,
space reserved up front (unless the caller checked the room itself), and an fsync at the end;
and the directory-level steps around it."""

from __future__ import annotations

import errno
import itertools
import os
from pathlib import Path

from stashpoint._storage import fdtrack
from stashpoint._storage.base import FileWriter
from stashpoint._storage.directio import ALIGN, address
from stashpoint.errors import CheckpointError

_BLOCK = 64 * 1024 * 1024


def _ident(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def link_new(src: Path, dst: Path) -> None:
    """Give ``src`` the name ``dst`` atomically, failing with FileExistsError if ``dst`` exists
    (a hard link is created or not; a rename would replace). File systems without hard links
    fall back to a check and a rename, which two racing writers can both pass."""
    try:
        os.link(src, dst)
    except FileExistsError:
        raise FileExistsError(errno.EEXIST, "already exists", str(dst)) from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, "already exists", str(dst)) from None
        os.replace(src, dst)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    fdtrack.track(fd)
    try:
        os.fsync(fd)
    finally:
        fdtrack.forget(fd)
        os.close(fd)


class LocalWriter(FileWriter):
    """Writes a file in order. Aligned spans go through O_DIRECT where the filesystem allows it
    (steady bandwidth, no CPU spent copying into the page cache); the rest is buffered."""

    def __init__(
        self,
        path: Path,
        size: int,
        *,
        direct: bool = False,
        dir_fd: int | None = None,
        durable: bool = True,
        reserve: bool = True,
    ) -> None:
        # dir_fd: the file is ``path.name`` in that directory, which this writer then owns;
        # durable=False: no fsync at the end (a copy that can be fetched again); reserve=False:
        # no space reserved up front (the caller checked it; on tmpfs reserving zeroes every page
        # on the caller's thread, where writing allocates them on the writer's)
        self._durable = durable
        self._path = path
        self._at = dir_fd
        self._pos = 0
        self._fd = self._dfd = -1
        cloexec = getattr(os, "O_CLOEXEC", 0)
        fdtrack.track(dir_fd)  # owned from here
        try:
            self._fd = os.open(self._name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | cloexec, 0o644, dir_fd=dir_fd)
            fdtrack.track(self._fd)
            if reserve and size > 0 and hasattr(os, "posix_fallocate"):
                try:  # reserve the space up front: a full disk fails now, not half-way through
                    os.posix_fallocate(self._fd, 0, size)
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):  # named: fallocate names nothing
                        raise OSError(e.errno, f"{e.strerror} (reserving {size:,} bytes)", str(path)) from None
            if direct and hasattr(os, "O_DIRECT"):
                try:
                    nofollow = getattr(os, "O_NOFOLLOW", 0)
                    self._dfd = os.open(self._name, os.O_WRONLY | os.O_DIRECT | cloexec | nofollow, dir_fd=dir_fd)
                    fdtrack.track(self._dfd)
                except OSError:  # e.g. tmpfs: no direct I/O, buffered writes only
                    self._dfd = -1
                if self._dfd >= 0 and _ident(self._dfd) != _ident(self._fd):  # replaced in between: not ours
                    self._forget_direct()
        except BaseException:
            if self._fd >= 0:
                self.abort()
            else:
                self._close_fds()
            raise

    @property
    def _name(self) -> str | Path:
        return self._path if self._at is None else self._path.name

    def _pwrite_all(self, fd: int, mv: memoryview) -> None:
        while len(mv):
            n = os.pwrite(fd, mv[:_BLOCK], self._pos)
            mv = mv[n:]
            self._pos += n

    def write(self, data: memoryview | bytes) -> None:
        mv = memoryview(data).cast("B")
        if self._dfd >= 0 and self._pos % ALIGN == 0:
            addr = address(mv)
            aligned = len(mv) // ALIGN * ALIGN
            if addr is not None and addr % ALIGN == 0 and aligned:
                start = self._pos
                try:
                    self._pwrite_all(self._dfd, mv[:aligned])
                    mv = mv[aligned:]
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self._forget_direct()  # this filesystem refuses the alignment: buffered from now on
                    mv = mv[self._pos - start :]
        if len(mv):
            self._pwrite_all(self._fd, mv)

    def close(self) -> None:
        try:
            if self._durable:
                os.fsync(self._fd)
        finally:
            self._close_fds(keep_dir=True)  # an abort after a failed fsync still needs it
        self._close_fds()

    def _forget_direct(self) -> None:
        fd, self._dfd = self._dfd, -1
        fdtrack.forget(fd)
        os.close(fd)

    def _close_fds(self, keep_dir: bool = False) -> None:
        # each descriptor is forgotten before it is closed: a failed close() has freed it
        # anyway, and closing its number again could close another thread's file
        fds = [self._fd, self._dfd]
        self._fd = self._dfd = -1
        if self._at is not None and not keep_dir:
            fds.append(self._at)
            self._at = None
        fdtrack.forget(*fds)
        errors = []
        for fd in fds:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError as e:
                    errors.append(e)
        if errors:
            raise errors[0]

    def abort(self) -> None:
        try:
            self._close_fds(keep_dir=True)
        finally:
            try:
                os.unlink(self._name, dir_fd=self._at)
            except FileNotFoundError:
                pass
            finally:
                self._close_fds()


def sync_parent(path: Path) -> None:
    """fsync the directory ``path``; one this process may enter but not read (a drop box, mode
    0733) cannot be opened to sync, and the save goes on without it."""
    try:
        fsync_dir(path)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EINVAL):
            raise


_MKDIR_FIXES = {
    errno.EROFS: "its file system is mounted read-only: choose a path on a writable one",
    errno.ENOSPC: "its file system is full: free space there (older checkpoints?) or choose another path",
    errno.EDQUOT: "the disk quota is used up: free space there or choose another path",
    errno.EMFILE: "this process has too many files open: raise its limit (ulimit -n) or close files",
    errno.ENFILE: "the system has too many files open: close files, or raise fs.file-max",
}


def make_root(root: Path) -> None:
    """Create ``root`` (and its parents, durably), or say what is in the way and how to fix it."""
    made = list(itertools.takewhile(lambda p: not os.path.lexists(p), (root, *root.parents)))
    try:
        root.mkdir(parents=True, exist_ok=True)
        for path in made:  # a new directory's name is durable once its parent is synced
            sync_parent(path.parent)
    except (FileExistsError, NotADirectoryError):  # a file where a directory must be
        blocker = next((p for p in (root, *root.parents) if p.exists() and not p.is_dir()), root)
        dangling = next((p for p in (root, *root.parents) if p.is_symlink() and not p.exists()), None)
        if dangling is not None:
            raise CheckpointError(
                f"{dangling} is a symbolic link to {dangling.readlink()}, which does not exist; create "
                "that directory (e.g. mount the volume it is on) or remove the link"
            ) from None
        raise CheckpointError(
            f"{blocker} exists and is not a directory"
            + ("" if blocker == root else f", so {root} cannot be made under it")
            + "; a checkpoint is a directory: remove the file or choose another path"
        ) from None
    except OSError as e:  # permissions, a read-only file system, no space
        fix = _MKDIR_FIXES.get(
            e.errno or 0, "choose a path this process can write to, or fix the permissions of its parent"
        )
        raise CheckpointError(f"cannot create the checkpoint directory {root}: {e.strerror or e}; {fix}") from None
    if root.is_symlink() or not root.is_dir():
        what = (
            "a symbolic link, which is not followed inside a checkpoint or run directory"
            if root.is_symlink()
            else "not a directory"
        )
        raise CheckpointError(f"{root} is {what}; remove it or choose another path")
