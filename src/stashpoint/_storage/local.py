"""The local-filesystem backend: direct I/O for large aligned writes and reads, fsync of files
and directories, an exclusive commit by hard link, and only regular files read."""

from __future__ import annotations

import builtins
import contextlib
import copy
import errno
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from stashpoint._core.naming import is_group_dir, partial_name, split_group
from stashpoint._storage import fdtrack
from stashpoint._storage.base import FileWriter, Storage, env_number
from stashpoint._storage.directio import ALIGN, MIN_DIRECT_BYTES, BouncePool, drop_front, readv_direct
from stashpoint._storage.localwrite import LocalWriter, fsync_dir, link_new, make_root
from stashpoint._storage.oserror import file_kind, not_regular
from stashpoint._storage.pagecache import keep_cached, read_resident, resident_at, resident_sampled
from stashpoint.errors import CheckpointError, CorruptCheckpointError

_IOV_MAX = 512


_NOFOLLOW = getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


DIRECT_ALIGN = ALIGN
# errors of an O_DIRECT open or read that mean "not on this file system": read buffered instead
_NO_DIRECT = {errno.EINVAL, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}
_MAX_TREE = 1_000_000  # files a leftover may hold for tree() to list them all (a step at 16,384 ranks: ~33k)


def user_path(path: str | os.PathLike[str]) -> str:
    """``path`` as text, a leading ``~`` or ``~user`` expanded as a shell does (``./~`` and an
    unknown user's are kept); a URL as it is. A directory named "~" made in the working
    directory is one a later ``rm -rf ~`` turns into the loss of the home directory."""
    text = os.fspath(path)
    return text if "://" in text else os.path.expanduser(text)  # noqa: PTH111 - pathlib folds "./~" into "~"


class LocalStorage(Storage):
    """A checkpoint directory on a local or shared POSIX filesystem.

    With ``direct_io`` (the default) shard data is written, and large ranges are read, with
    ``O_DIRECT`` where the file system allows it, and through the page cache where it does not
    (tmpfs) or for small, unaligned pieces. ``write_streams`` shard files of a save are written
    at once, each on a thread of its own, so that one file's checksums and fsync overlap
    another's writes; storage that serves several streams faster than one (striped or parallel
    file systems, NVMe arrays) gains from more (figures: benchmarks/RESULTS.md, "Parallel writes").

    With ``cache_newest`` (default: on, ``STASHPOINT_CACHE_NEWEST=0`` turns it off) a committed
    save's shards are read back into the page cache in the background, within half the memory
    available, and the previous save's in the same run directory are let go: a process restarted
    on this node after a crash loads from memory (reads take what is cached without waiting and
    read the rest directly).
    """

    local_reads = True

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        direct_io: bool = True,
        write_streams: int = 2,
        cache_newest: bool | None = None,
    ) -> None:
        if not isinstance(write_streams, int) or isinstance(write_streams, bool) or write_streams < 1:
            raise ValueError(f"write_streams must be a whole number of at least 1, got {write_streams!r}")
        # absolute now: a save's files are written later, on another thread, and a chdir
        # meanwhile must not send them elsewhere (links are kept as given, not resolved)
        self.root = Path(user_path(root)).absolute()
        self.direct_io = direct_io
        self.write_streams = write_streams
        if cache_newest is None:
            cache_newest = env_number("STASHPOINT_CACHE_NEWEST", 1, 0, 1) == 1
        self.cache_newest = cache_newest
        self._bounce = BouncePool()
        self._direct_reads = direct_io and hasattr(os, "O_DIRECT")  # off once the file system refuses
        self._touched: set[str] = set()  # group directories written into since the last sync()
        self._twin: LocalStorage | None = None  # this storage without direct reads (``_plain``)

    @property
    def location(self) -> str:
        return str(self.root)

    def prepare(self) -> None:
        make_root(self.root)

    def _split(self, name: str) -> tuple[str, str]:
        parts = split_group(name)
        if parts is None:
            raise ValueError(f"{name!r} is not a file name inside a checkpoint (a plain name, or g<digits>/name)")
        return parts

    def _open_dir(self, group: str, *, create: bool = False) -> int:
        """A descriptor of the group directory ``group``, never reached through a symbolic link
        (which could lead reads and deletes outside the checkpoint)."""
        path = self.root / group
        if create:
            with contextlib.suppress(FileExistsError):
                path.mkdir()
        try:
            return os.open(path, os.O_RDONLY | _DIRECTORY | _NOFOLLOW)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            kind = "symbolic link" if path.is_symlink() else "file"
            raise CorruptCheckpointError(
                f"{path} is a {kind}, not a directory; a checkpoint's group directories are plain directories, "
                "so it is refused (remove it, or use another path)"
            ) from None

    @contextlib.contextmanager
    def _where(self, name: str) -> Iterator[tuple[int | None, str | Path]]:
        """``(dir_fd, path)`` to reach ``name`` by: the root's path, or its group's descriptor."""
        group, leaf = self._split(name)
        if not group:
            yield None, self.root / leaf
            return
        fd = self._open_dir(group)
        try:
            yield fd, leaf
        finally:
            os.close(fd)

    def open_writer(self, name: str, size: int) -> FileWriter:
        group, leaf = self._split(name)
        if not group:
            return LocalWriter(self.root / leaf, size, direct=self.direct_io)
        fd = self._open_dir(group, create=True)
        self._touched.add(group)
        return LocalWriter(self.root / name, size, direct=self.direct_io, dir_fd=fd)  # which owns fd

    def open_sparse(self, name: str, size: int) -> int:
        """A descriptor of ``name`` for writes at any offset (a sparse copy: what is not written
        stays a hole), created ``size`` bytes long if it is not, never reached through a
        symbolic link; ``sync()`` makes its name durable. The caller closes it."""
        group, leaf = self._split(name)
        at = self._open_dir(group, create=True) if group else None
        try:
            flags = os.O_RDWR | os.O_CREAT | _NOFOLLOW
            fd = os.open(leaf if at is not None else self.root / leaf, flags, 0o644, dir_fd=at)
        finally:
            if at is not None:
                os.close(at)
        if group:
            self._touched.add(group)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise not_regular(self.root / name, file_kind(st.st_mode))
            if st.st_size != size:
                os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def sync(self) -> None:
        """Make the names written since the last call durable: the root's and its group
        directories' entries."""
        for group in sorted(self._touched):
            fd = self._open_dir(group)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self._touched.clear()
        fsync_dir(self.root)

    def commit(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        tmp = self.root / partial_name(name, uuid.uuid4().hex)
        try:
            w = LocalWriter(tmp, len(data))
            w.write(data)
            w.close()
            if exclusive:
                link_new(tmp, self.root / name)
                tmp.unlink()
            else:
                os.replace(tmp, self.root / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.root)

    def _open_read(self, name: str, flags: int = 0) -> int:
        """Open a file of the checkpoint for reading. Only a regular file is opened: a symbolic
        link could point anywhere outside the checkpoint, and opening a FIFO would block until
        some writer came (the open does not block; what it opened is checked before any read)."""
        path = self.root / name
        try:
            with self._where(name) as (at, leaf):
                fd = os.open(leaf, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK | flags, dir_fd=at)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise not_regular(path, "symbolic link") from None
            raise
        fdtrack.track(fd)  # the caller closes it with fdtrack.close
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            fdtrack.close(fd)
            raise not_regular(path, file_kind(mode))
        return fd

    def read(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        fd = self._open_read(name)
        try:
            with os.fdopen(fd, "rb", closefd=False) as f:
                f.seek(offset)
                if length is None:
                    return f.read()
                # a read allocates the length asked for first: asked no more than the file holds
                # (and a byte, to see one grown meanwhile), a generous bound costs nothing
                return f.read(max(0, min(length, os.fstat(fd).st_size - offset + 1)))
        finally:
            fdtrack.close(fd)

    def readv(self, name: str, offset: int, buffers: Sequence[memoryview]) -> None:
        pending = [b.cast("B") for b in buffers if len(b)]
        if self._direct_reads and sum(len(b) for b in pending) >= MIN_DIRECT_BYTES:
            fd = self._open_read(name)  # what the page cache holds first (see ``cache_newest``)
            try:
                got = read_resident(fd, offset, pending)
            finally:
                fdtrack.close(fd)
            offset += got
            pending = drop_front(pending, got)
        if self._direct_reads and sum(len(b) for b in pending) >= MIN_DIRECT_BYTES:
            filled = self._readv_direct(name, offset, pending)
            if filled is not None:  # None: refused, all of it read buffered below
                offset += filled
                pending = drop_front(pending, filled)
        if not pending:
            return
        fd = self._open_read(name)
        try:
            self._preadv_all(fd, name, offset, pending)
        finally:
            fdtrack.close(fd)

    def _preadv_all(self, fd: int, name: str, pos: int, pending: list[memoryview]) -> None:
        while pending:
            n = os.preadv(fd, pending[:_IOV_MAX], pos)
            if n == 0:
                raise EOFError(f"{self.root / name} ended at byte {pos}, before the data it holds")
            pos += n
            pending = drop_front(pending, n)

    @contextlib.contextmanager
    def reading(self, name: str) -> Iterator[Callable[[int, Sequence[memoryview]], None]]:
        # direct reads: each read decides between the cache and the disk; a subclass's own
        # readv: each read goes through it
        if self._direct_reads or type(self).readv is not LocalStorage.readv:
            with super().reading(name) as each:
                yield each
            return
        # opened once: a 64 MiB job checked as it lands reads 4 MiB at a time, and an open,
        # fstat and close around each read made three more calls that give up the GIL
        fd = self._open_read(name)
        try:
            yield lambda offset, buffers: self._preadv_all(fd, name, offset, [b.cast("B") for b in buffers if len(b)])
        finally:
            fdtrack.close(fd)

    def cached(self, name: str, offset: int) -> bool:
        return self._resident(name, lambda fd: resident_at(fd, offset))

    def reads_for(self, name: str, offset: int, length: int) -> Storage:
        if not self._direct_reads or not self._resident(name, lambda fd: resident_sampled(fd, offset, length)):
            return self
        return self._plain()

    def _resident(self, name: str, ask: Callable[[int], bool]) -> bool:
        try:
            fd = self._open_read(name)
        except (OSError, ValueError, CheckpointError):  # a hint: a name it cannot open is not cached
            return False
        try:
            return ask(fd)
        finally:
            fdtrack.close(fd)

    def _plain(self) -> LocalStorage:
        """This storage reading without direct I/O: a copy, so that a subclass keeps its own
        behaviour and state (made once, kept)."""
        twin = self._twin
        if twin is None:
            twin = copy.copy(self)
            twin._direct_reads, twin.cache_newest, twin._twin = False, False, None
            twin._bounce, twin._touched = BouncePool(), set()
            self._twin = twin
        return twin

    def shared_reads(self) -> LocalStorage:
        """This checkpoint for reads that other processes on this host make too (ranks reading
        the same replicated tensors): through the page cache, so that the disk serves each byte
        about once and the first reader's pages serve the others."""
        return self._plain() if self._direct_reads else self

    def keep_cached(self, names: Sequence[str], *, beside: int | None = None) -> None:
        if self.cache_newest:
            keep_cached(self.root, [self.root / n for n in names], beside=beside)

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
            fdtrack.close(fd)

    def size(self, name: str) -> int:
        with self._where(name) as (at, leaf):
            st = os.stat(leaf, dir_fd=at, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise not_regular(self.root / name, file_kind(st.st_mode))
        return st.st_size

    def exists(self, name: str | None = None) -> bool:
        if name is None or "/" not in name:
            return (self.root if name is None else self.root / name).exists()
        try:
            with self._where(name) as (at, leaf):
                os.stat(leaf, dir_fd=at, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError, CorruptCheckpointError):  # not reachable inside the checkpoint
            return False
        return True

    def list(self) -> list[str]:
        """The files at the root, and those in its group directories as ``g00012/name``."""
        out = []
        try:
            for p in self.root.iterdir():
                if not p.is_dir():
                    out.append(p.name)
                elif is_group_dir(p.name) and not p.is_symlink():
                    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                        out.extend(f"{p.name}/{q.name}" for q in p.iterdir() if not q.is_dir())
        except FileNotFoundError:
            return []
        return sorted(out)

    def tree(self) -> builtins.list[str] | None:
        """See :meth:`Storage.tree`; a link or file where the directory goes holds nothing (it is
        removed itself, never followed); a subdirectory that cannot be read: None."""
        if self.root.is_symlink() or not self.root.is_dir():
            return []
        out: list[str] = []

        def refuse(e: OSError) -> None:
            raise e

        try:
            for top, dirs, files in os.walk(self.root, onerror=refuse):
                rel = os.path.relpath(top, self.root)
                links = [d for d in dirs if (Path(top) / d).is_symlink()]  # entries, never followed
                out.extend(n if rel == "." else f"{rel}/{n}" for n in (*files, *links))
                if len(out) > _MAX_TREE:
                    return None
        except OSError:
            return None
        return sorted(out)

    def delete(self, name: str) -> None:
        try:
            with self._where(name) as (at, leaf):
                os.unlink(leaf, dir_fd=at)
        except FileNotFoundError:
            pass

    def _options(self) -> dict[str, Any]:
        return {"direct_io": self.direct_io, "write_streams": self.write_streams, "cache_newest": self.cache_newest}

    def child(self, name: str) -> LocalStorage:
        return type(self)(self.root / name, **self._options())

    def children(self) -> builtins.list[str]:
        try:
            return sorted(
                p.name for p in self.root.iterdir() if p.is_dir() and not p.is_symlink() and not is_group_dir(p.name)
            )
        except FileNotFoundError:
            return []

    def remove_tree(self) -> None:
        """Remove this directory and what it holds; a file or symbolic link in its place is
        removed itself (never followed)."""
        try:
            if not os.path.lexists(self.root):  # nothing to remove (a read-only file system says EROFS, not ENOENT)
                return
            if self.root.is_symlink() or not self.root.is_dir():
                self.root.unlink()
            else:
                shutil.rmtree(self.root)
        except FileNotFoundError:
            pass

    def move(self, name: str) -> LocalStorage:
        target = self.root.parent / name
        self.root.rename(target)
        fsync_dir(self.root.parent)
        return type(self)(target, **self._options())
