"""The local-filesystem backend: direct I/O for large aligned writes and reads, fsync of files
and directories, an exclusive commit by hard link, and only regular files read."""

from __future__ import annotations

import builtins
import errno
import os
import shutil
import stat
import uuid
from collections.abc import Sequence
from pathlib import Path

from stashpoint._storage.base import FileWriter, Storage
from stashpoint._storage.directio import ALIGN, MIN_DIRECT_BYTES, BouncePool, address, readv_direct
from stashpoint.errors import CheckpointError, CorruptCheckpointError

_BLOCK = 64 * 1024 * 1024
_IOV_MAX = 512


_NOFOLLOW = getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISLNK, "symbolic link"), (stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO")):
        if test(mode):
            return kind
    return "special file"


def not_regular(path: Path, kind: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path} is a {kind}, not a regular file; a checkpoint holds only regular files, so it is refused "
        "(remove it, or load an earlier checkpoint)"
    )


def _link_new(src: Path, dst: Path) -> None:
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


DIRECT_ALIGN = ALIGN
# errors of an O_DIRECT open or read that mean "not on this file system": read buffered instead
_NO_DIRECT = {errno.EINVAL, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}


def _drop_front(buffers: list[memoryview], n: int) -> list[memoryview]:
    """``buffers`` without their first ``n`` bytes (a partly filled buffer keeps its rest)."""
    out = list(buffers)
    while n and out:
        if n >= len(out[0]):
            n -= len(out.pop(0))
        else:
            out[0] = out[0][n:]
            n = 0
    return out


class _LocalWriter(FileWriter):
    """Writes a file in order. Aligned spans go through O_DIRECT where the filesystem allows it
    (steady bandwidth, no CPU spent copying into the page cache); the rest is buffered."""

    def __init__(self, path: Path, size: int, *, direct: bool = False) -> None:
        self._path = path
        self._pos = 0
        self._dfd = -1
        cloexec = getattr(os, "O_CLOEXEC", 0)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | cloexec, 0o644)
        try:
            if size > 0 and hasattr(os, "posix_fallocate"):
                try:  # reserve the space up front: a full disk fails now, not half-way through
                    os.posix_fallocate(self._fd, 0, size)
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                        raise
            if direct and hasattr(os, "O_DIRECT"):
                try:
                    self._dfd = os.open(path, os.O_WRONLY | os.O_DIRECT | cloexec)
                except OSError:  # e.g. tmpfs: no direct I/O, buffered writes only
                    self._dfd = -1
        except BaseException:
            self.abort()
            raise

    def _pwrite_all(self, fd: int, mv: memoryview) -> None:
        while len(mv):
            n = os.pwrite(fd, mv[:_BLOCK], self._pos)
            mv = mv[n:]
            self._pos += n

    def write(self, data: memoryview | bytes) -> None:
        mv = memoryview(data).cast("B")
        if self._dfd >= 0 and self._pos % DIRECT_ALIGN == 0:
            addr = address(mv)
            aligned = len(mv) // DIRECT_ALIGN * DIRECT_ALIGN
            if addr is not None and addr % DIRECT_ALIGN == 0 and aligned:
                start = self._pos
                try:
                    self._pwrite_all(self._dfd, mv[:aligned])
                    mv = mv[aligned:]
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    os.close(self._dfd)  # this filesystem refuses the alignment: buffered from now on
                    self._dfd = -1
                    mv = mv[self._pos - start :]
        if len(mv):
            self._pwrite_all(self._fd, mv)

    def close(self) -> None:
        try:
            os.fsync(self._fd)
        finally:
            self._close_fds()

    def _close_fds(self) -> None:
        for fd in (self._fd, self._dfd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._dfd = -1

    def abort(self) -> None:
        self._close_fds()
        try:
            self._path.unlink()
        except FileNotFoundError:
            pass


class LocalStorage(Storage):
    """A checkpoint directory on a local or shared POSIX filesystem.

    With ``direct_io`` (the default) shard data is written, and large ranges are read, with
    ``O_DIRECT`` where the file system allows it, and through the page cache where it does not
    (tmpfs) or for small, unaligned pieces. ``write_streams`` shard files of a save are written
    at once, each on a thread of its own, so that one file's checksums and fsync overlap
    another's writes; storage that serves several streams faster than one (striped or parallel
    file systems, NVMe arrays) gains from more (figures: benchmarks/RESULTS.md, "Parallel writes").
    """

    def __init__(self, root: str | os.PathLike[str], *, direct_io: bool = True, write_streams: int = 2) -> None:
        if not isinstance(write_streams, int) or isinstance(write_streams, bool) or write_streams < 1:
            raise ValueError(f"write_streams must be a whole number of at least 1, got {write_streams!r}")
        self.root = Path(root)
        self.direct_io = direct_io
        self.write_streams = write_streams
        self._bounce = BouncePool()
        self._direct_reads = direct_io and hasattr(os, "O_DIRECT")  # off once the file system refuses

    @property
    def location(self) -> str:
        return str(self.root)

    def prepare(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):  # a file where a directory must be
            raise CheckpointError(
                f"{self.root} exists and is not a directory; a checkpoint is a directory: remove the file or "
                "choose another path"
            ) from None
        if self.root.is_symlink() or not self.root.is_dir():
            raise CheckpointError(f"{self.root} is not a directory (a symbolic link?); choose another path")

    def open_writer(self, name: str, size: int) -> FileWriter:
        return _LocalWriter(self.root / name, size, direct=self.direct_io)

    def sync(self) -> None:
        _fsync_dir(self.root)

    def commit(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        tmp = self.root / f".{name}.{uuid.uuid4().hex}.partial"
        try:
            w = _LocalWriter(tmp, len(data))
            w.write(data)
            w.close()
            if exclusive:
                _link_new(tmp, self.root / name)
                tmp.unlink()
            else:
                os.replace(tmp, self.root / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(self.root)

    def _open_read(self, name: str, flags: int = 0) -> int:
        """Open a file of the checkpoint for reading. Only a regular file is opened: a symbolic
        link could point anywhere outside the checkpoint, and opening a FIFO would block until
        some writer came (the open does not block; what it opened is checked before any read)."""
        path = self.root / name
        try:
            fd = os.open(path, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK | flags)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise not_regular(path, "symbolic link") from None
            raise
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise not_regular(path, _kind(mode))
        return fd

    def read(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        with os.fdopen(self._open_read(name), "rb") as f:
            f.seek(offset)
            return f.read() if length is None else f.read(length)

    def readv(self, name: str, offset: int, buffers: Sequence[memoryview]) -> None:
        pending = [b.cast("B") for b in buffers if len(b)]
        if self._direct_reads and sum(len(b) for b in pending) >= MIN_DIRECT_BYTES:
            filled = self._readv_direct(name, offset, pending)
            if filled is not None:  # None: refused, all of it read buffered below
                offset += filled
                pending = _drop_front(pending, filled)
        if not pending:
            return
        fd = self._open_read(name)
        try:
            pos = offset
            while pending:
                n = os.preadv(fd, pending[:_IOV_MAX], pos)
                if n == 0:
                    raise EOFError(f"{self.root / name} ended at byte {pos}, before the data it holds")
                pos += n
                pending = _drop_front(pending, n)
        finally:
            os.close(fd)

    def shared_reads(self) -> LocalStorage:
        """This checkpoint for reads that other processes on this host make too (ranks reading
        the same replicated tensors): through the page cache, so that the disk serves each byte
        about once and the first reader's pages serve the others."""
        return type(self)(self.root, direct_io=False) if self._direct_reads else self

    def _readv_direct(self, name: str, offset: int, buffers: list[memoryview]) -> int | None:
        """Bytes filled by an ``O_DIRECT`` read; None if the file system refuses direct I/O."""
        try:
            fd = self._open_read(name, os.O_DIRECT)
        except OSError as e:
            if e.errno not in _NO_DIRECT:
                raise
            self._direct_reads = False  # e.g. tmpfs: buffered reads from now on
            return None
        try:
            return readv_direct(fd, offset, buffers, self._bounce)
        except OSError as e:
            if e.errno not in _NO_DIRECT:
                raise
            self._direct_reads = False
            return None
        finally:
            os.close(fd)

    def size(self, name: str) -> int:
        st = (self.root / name).lstat()
        if not stat.S_ISREG(st.st_mode):
            raise not_regular(self.root / name, _kind(st.st_mode))
        return st.st_size

    def exists(self, name: str | None = None) -> bool:
        return (self.root if name is None else self.root / name).exists()

    def list(self) -> list[str]:
        try:
            return sorted(p.name for p in self.root.iterdir() if not p.is_dir())
        except FileNotFoundError:
            return []

    def delete(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)

    def child(self, name: str) -> LocalStorage:
        return type(self)(self.root / name, direct_io=self.direct_io, write_streams=self.write_streams)

    def children(self) -> builtins.list[str]:
        try:
            return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.is_symlink())
        except FileNotFoundError:
            return []

    def remove_tree(self) -> None:
        """Remove this directory and what it holds; a file or symbolic link in its place is
        removed itself (never followed)."""
        try:
            if self.root.is_symlink() or not self.root.is_dir():
                self.root.unlink()
            else:
                shutil.rmtree(self.root)
        except FileNotFoundError:
            pass

    def move(self, name: str) -> LocalStorage:
        target = self.root.parent / name
        self.root.rename(target)
        _fsync_dir(self.root.parent)
        return type(self)(target, direct_io=self.direct_io, write_streams=self.write_streams)
