"""Where a node-local restore lands what it fetches when the node's directory is on a disk: in
memory the node's processes share (a directory on ``/dev/shm``), so that the load reads those
bytes from memory and not back from the disk they were just written to. Once the load is
done, they are copied into the node's directory in the background (:func:`settle`: marked
partial until whole, the manifest last, as a landing does) and the memory copy is removed.
What memory has no room for lands on the disk as before.

The area is ``<STASHPOINT_FETCH_MEMORY, default /dev/shm>/stashpoint-<uid>/fetch-<key>``, the
key naming the node directory's file (device and inode): a directory of this user's alone,
held by its manager's leader with an ``flock`` on ``fetch-<key>.lock`` (released by the kernel
when the process dies). Areas no process holds, left by a crash, are removed with their lock
files by the next manager of this user on the host; the lock is checked to be the file still
at that name first, so an area made anew meanwhile is never taken for a leftover.
``STASHPOINT_FETCH_MEMORY=off`` turns it off."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import mmap
import os
import re
import shutil
import stat
import threading
import time
from pathlib import Path

from stashpoint._core.naming import MANIFEST_NAME, PARTIAL_RE, index_name, parse_save_file
from stashpoint._dist.landing import Landing, partial_name
from stashpoint._storage import LocalStorage, Storage
from stashpoint._storage.overlay import Overlay
from stashpoint.errors import CheckpointError

log = logging.getLogger("stashpoint")

ENV = "STASHPOINT_FETCH_MEMORY"
_MEMORY_FS = frozenset({"tmpfs", "ramfs"})
_ESCAPED = re.compile(r"\\([0-7]{3})")


def area(root: Path) -> Path | None:
    """The memory area a restore into the node directory ``root`` lands in; None where there
    is none: turned off, no such memory directory or one other users could swap entries in
    (writable by them and not sticky), ``root`` missing, or ``root`` itself in memory (a memory
    tier gains nothing from a second copy)."""
    # a shared directory: sticky (or not writable by others), and the area's parent this user's alone
    base = Path(os.environ.get(ENV, "/dev/shm").strip())  # noqa: S108
    if str(base).lower() in ("", ".", "off", "0", "no", "false"):
        return None
    try:
        info, node = base.stat(), root.stat()
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or (info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX):
        return None
    if in_memory(root):
        return None
    key = hashlib.sha256(f"{node.st_dev}:{node.st_ino}:{os.path.realpath(root)}".encode()).hexdigest()[:16]
    return base / f"stashpoint-{os.getuid()}" / f"fetch-{key}"


def in_memory(path: Path) -> bool:
    """Whether ``path`` is on a memory file system (tmpfs, ramfs), by the mount that holds it."""
    real = os.path.realpath(path)
    try:
        lines = os.fsdecode(Path("/proc/self/mountinfo").read_bytes()).splitlines()
    except OSError:
        return False
    best, fstype = "", ""
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        mount = _ESCAPED.sub(lambda m: chr(int(m[1], 8)), fields[4])
        if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, fstype = mount, right.split()[0]
    return fstype in _MEMORY_FS


def _private(owner: Path, *, create: bool) -> bool:
    """Whether ``owner`` (``<base>/stashpoint-<uid>``) is a directory of this user's alone,
    which no other user could have put files in; made so first with ``create``."""
    try:
        if create:
            owner.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(owner)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077


def claim(where: Path | None) -> int | None:
    """Hold the area ``where`` for this process (its node's leader), first removing the areas
    of this user no process holds (a crash's leftovers): the lock's descriptor, or None where
    the area cannot be used (its parent not this user's alone, or another process holds it).
    An area is used only while its user holds the lock file that bears its name: a lock taken
    on a file a sweeper removed meanwhile is let go and the name opened again."""
    if where is None or not _private(where.parent, create=True):
        return None
    names = {p.name.removesuffix(".lock") for p in where.parent.glob("fetch-*")}
    for name in sorted(names - {where.name}):
        _take(where.parent / f"{name}.lock", sweep=True)
    for _ in range(100):  # another manager sweeping leftovers holds it for a moment
        fd = _take(where.parent / f"{where.name}.lock", sweep=False)
        if fd is not None:
            shutil.rmtree(where, ignore_errors=True)  # what this node's last holder left
            return fd
        time.sleep(0.01)
    return None


def _take(lock: Path, *, sweep: bool) -> int | None:
    """The lock ``lock`` taken, if no one holds it and it is still the file at that name; with
    ``sweep``, its area and the lock file removed and None returned."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(lock, flags, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        mine, now = os.fstat(fd), os.lstat(lock)
        if (mine.st_dev, mine.st_ino) != (now.st_dev, now.st_ino):
            raise FileNotFoundError(lock)  # removed (and perhaps made anew) meanwhile
        if sweep:
            shutil.rmtree(lock.with_suffix(""), ignore_errors=True)
            lock.unlink()
    except OSError:
        os.close(fd)  # held: a live manager's (or swept by another meanwhile)
        return None
    if sweep:
        os.close(fd)
        return None
    return fd


class FetchView(Overlay):
    """A step as a node's ranks read it during and after a fetch: the files landed in the
    memory area's step directory over the node's. On the leader it also counts what may still
    land in memory (:func:`landing_target`)."""

    def __init__(self, top: LocalStorage, base: LocalStorage) -> None:
        super().__init__(top, base)
        self.mem, self.disk = top, base
        self.budget: int | None = None  # bytes: set at the first landing


def view(at: Storage, where: Path | None) -> Storage:
    """Step directory ``at`` as this node's ranks read it during and after a fetch: a
    :class:`FetchView` of the memory area's step directory ``where`` over ``at``; ``at`` alone
    where there is no area, or its parent is not this user's alone (its files are not read)."""
    if where is None or not isinstance(at, LocalStorage) or not _private(where.parent.parent, create=True):
        return at
    return FetchView(LocalStorage(where, direct_io=False, cache_newest=False), at)


def disk_of(step: Storage) -> Storage:
    """The node's own directory of a step (a view's, or the step itself)."""
    return step.disk if isinstance(step, FetchView) else step


def landing_target(step: Storage, size: int) -> Storage:
    """Where a transfer of ``size`` bytes into ``step`` lands: a :func:`view`'s memory area
    while what the restore landed there stays within half of the memory the host can spare at
    its first landing (the area's free space, the memory available, this process's cgroup
    limit), else the node's directory."""
    if not isinstance(step, FetchView):
        return step
    if step.budget is None:
        step.budget = _spare(step.mem.root.parent.parent.parent) // 2
    if size > step.budget:
        log.info("stashpoint: %d fetched bytes land on disk: memory to spare for them is short", size)
        return step.disk
    try:
        if not _private(step.mem.root.parent.parent, create=True):
            return step.disk
        step.mem.root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("stashpoint: no memory area for a fetch at %s (%s); fetching to disk", step.mem.location, e)
        return step.disk
    step.budget -= size
    return step.mem


def _spare(base: Path) -> int:
    """The bytes of memory this process can spare for files in ``base``: the least of its
    free space, the host's available memory and the headroom of every memory cgroup limit
    above this process (v2 and v1)."""
    try:
        st = os.statvfs(base)
    except OSError:
        return 0
    spare = st.f_bavail * st.f_frsize
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                spare = min(spare, int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    return max(min(spare, _cgroup_headroom()), 0)


def _cgroup_headroom() -> int:
    """The least headroom (limit less usage) of the memory cgroups this process is in and
    their parents; a large number where none limits it or none can be read."""
    least = 1 << 62
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return least
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "":  # v2
            root, limit, usage = Path("/sys/fs/cgroup"), "memory.max", "memory.current"
        elif "memory" in controllers.split(","):  # v1
            root, limit, usage = Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        where = root / path.strip().lstrip("/")
        while True:
            try:
                top = (where / limit).read_text().strip()
                if top != "max":
                    least = min(least, int(top) - int((where / usage).read_text()))
            except (OSError, ValueError):
                pass  # not there (or not readable) at this level
            if where == root or root not in where.parents:
                break
            where = where.parent
    return least


def settle(mem: Path, disk: LocalStorage, stop: threading.Event | None = None) -> int:
    """Copy what a restore landed in ``mem`` into the node's step directory ``disk`` as the
    landing would have left it there: every saving rank it brought marked partial before any of
    its bytes land, the ranks whose files are whole unmarked once all are, sparse copies kept
    sparse (and marked), the manifest committed last. ``stop`` set: give up between files (the
    ranks stay marked). Returns the bytes copied."""
    src = LocalStorage(mem, direct_io=False, cache_newest=False)
    names = src.list()
    partial = {int(m[1]) for n in names if (m := PARTIAL_RE.fullmatch(n))}
    files: list[str] = []
    ranks, indexed = set(partial), set()
    for name in names:
        parsed = parse_save_file(name)
        if parsed is not None:
            files.append(name)
            ranks.add(parsed[0])
            if name.rpartition("/")[2] == index_name(*parsed):
                indexed.add(parsed[0])
    if not files and MANIFEST_NAME not in names:
        return 0
    disk.prepare()
    for r in sorted(ranks):
        disk.commit(partial_name(r), b"")
    target = Landing(disk.root, durable=False)
    copied = 0
    for name in files:
        copied += _copy(mem / name, target, name, stop)
    target.sync()  # the group directories it wrote into
    for r in sorted(indexed - partial):
        disk.delete(partial_name(r))
    if MANIFEST_NAME in names:
        disk.commit(MANIFEST_NAME, src.read(MANIFEST_NAME))
    return copied


def _extents(fd: int, size: int) -> list[tuple[int, int]]:
    """The byte ranges of a file that hold data (a sparse copy has holes between them)."""
    out: list[tuple[int, int]] = []
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:  # ENXIO: no data after ``pos``
            break
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        out.append((start, end))
        pos = end
    return out


def _stopped(stop: threading.Event | None, where: str) -> None:
    if stop is not None and stop.is_set():
        raise CheckpointError(f"copying the fetched files into {where} was stopped")


_PART = 64 << 20


def _copy(path: Path, target: Landing, name: str, stop: threading.Event | None = None) -> int:
    """One file of the memory area into ``target``: a whole one with direct writes from a
    private mapping of it (writable, so the writer can hand its pages to the device; never
    written), a sparse one range by range. Returns the bytes copied."""
    target.delete(name)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        spans = _extents(fd, size) if size else []
        if spans != [(0, size)]:
            return _copy_sparse(fd, target, name, size, spans, stop=stop)
        out = target.open_writer(name, size)
        try:
            with mmap.mmap(fd, size, access=mmap.ACCESS_COPY) as mm:
                data = memoryview(mm)
                try:
                    for at in range(0, size, _PART):  # a preemption's save stops it within a part
                        _stopped(stop, target.location)
                        out.write(data[at : at + _PART])
                finally:
                    data.release()
        except BaseException:
            out.abort()
            raise
        out.close()
        return size
    finally:
        os.close(fd)


def _copy_sparse(
    fd: int, target: Landing, name: str, size: int, spans: list[tuple[int, int]], *, stop: threading.Event | None
) -> int:
    out = target.open_sparse(name, size)
    try:
        for a, b in spans:
            for pos in range(a, b, _PART):
                _stopped(stop, target.location)
                data = memoryview(os.pread(fd, min(_PART, b - pos), pos))
                at = pos
                while data:
                    n = os.pwrite(out, data, at)
                    data, at = data[n:], at + n
    finally:
        os.close(out)
    return sum(b - a for a, b in spans)


def release(fd: int | None, where: Path | None) -> None:
    """Remove the area ``where`` and let go of its lock ``fd`` (from :func:`claim`)."""
    if fd is None:
        return
    try:
        if where is not None:
            shutil.rmtree(where, ignore_errors=True)
            with contextlib.suppress(OSError):  # a lock file left is swept by a later manager
                (where.parent / f"{where.name}.lock").unlink()
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def wipe(where: Path | None) -> None:
    """Remove what the area ``where`` holds, keeping it held (a missing one is fine)."""
    if where is not None and _private(where.parent, create=False):
        shutil.rmtree(where, ignore_errors=True)
