"""Where a node-local restore lands what it fetches when the node's directory is on a disk: in
memory the node's processes share (a directory on ``/dev/shm``), so that the load reads those
bytes from memory and not back from the disk they were just written to. Once the load is
done, the saving ranks' whole files are copied into the node's directory in the background
(:func:`settle`: marked partial until whole, the manifest last, as a landing does) and the
memory copy is removed. A transfer that memory has no room for lands on the disk as before.

The area is ``<STASHPOINT_FETCH_MEMORY, default /dev/shm>/stashpoint-<uid>/fetch-<key>``, the
key naming the node's directory: this user's alone, and what a crash left there is removed by
the next restore into the same directory. ``STASHPOINT_FETCH_MEMORY=off`` turns it off."""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import re
import shutil
import stat
from pathlib import Path

from stashpoint._core.naming import MANIFEST_NAME, index_name, parse_save_file
from stashpoint._dist.landing import PARTIAL_RE, Landing, partial_name
from stashpoint._storage import LocalStorage, Storage
from stashpoint._storage.overlay import Overlay

log = logging.getLogger("stashpoint")

ENV = "STASHPOINT_FETCH_MEMORY"
_MEMORY_FS = frozenset({"tmpfs", "ramfs"})
_ESCAPED = re.compile(r"\\([0-7]{3})")


def area(root: Path) -> Path | None:
    """The memory area a restore into the node directory ``root`` lands in; None where there
    is none: turned off, no such memory directory, or ``root`` itself in memory (a memory tier
    gains nothing from a second copy)."""
    # a shared directory: the area's parent is checked to be this user's alone before use
    base = os.environ.get(ENV, "/dev/shm").strip()  # noqa: S108
    if base.lower() in ("", "off", "0", "no", "false") or not Path(base).is_dir() or in_memory(root):
        return None
    key = hashlib.sha256(os.fsencode(os.path.realpath(root))).hexdigest()[:16]
    return Path(base) / f"stashpoint-{os.getuid()}" / f"fetch-{key}"


def in_memory(path: Path) -> bool:
    """Whether ``path`` is on a memory file system (tmpfs, ramfs), by the mount that holds it."""
    real = os.path.realpath(path)
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
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


def view(at: Storage, where: Path | None) -> Storage:
    """Step directory ``at`` as this node's ranks read it during and after a fetch: the files
    landed in the memory area's step directory ``where`` over ``at``; ``at`` alone where the
    area's parent is not this user's alone (another user made it first: its files are not read)."""
    if where is None or not isinstance(at, LocalStorage):
        return at
    if not _private(where.parent.parent, create=True):
        log.warning("stashpoint: %s is not a directory of this user's alone; fetching to disk", where.parent.parent)
        return at
    return Overlay(LocalStorage(where, direct_io=False, cache_newest=False), at)


def landing_target(step: Storage, size: int) -> Storage:
    """Where a transfer of ``size`` bytes into ``step`` lands: a :func:`view`'s memory area when
    it has room for them with half its free space left over, else the node's directory."""
    if not isinstance(step, Overlay) or not isinstance(step.top, LocalStorage):
        return step
    mem = step.top
    owner = mem.root.parent.parent  # <base>/stashpoint-<uid>
    try:
        st = os.statvfs(owner.parent)
        if size > st.f_bavail * st.f_frsize // 2:
            log.info("stashpoint: %d bytes fetched land on disk: %s lacks the room", size, owner.parent)
            return step.base
        if not _private(owner, create=True):
            return step.base
        mem.root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("stashpoint: no memory area for a fetch at %s (%s); fetching to disk", owner, e)
        return step.base
    return mem


def settle(mem: Path, disk: LocalStorage) -> int:
    """Copy what a restore landed in ``mem`` into the node's step directory ``disk`` as the
    landing would have left it there: every saving rank it brought marked partial before any of
    its bytes land, the ranks whose files are whole unmarked once all are, sparse copies kept
    sparse (and marked), the manifest committed last. Returns the bytes copied."""
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
    copied = sum(_copy(mem / name, target, name) for name in files)
    disk.sync()
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


def _copy(path: Path, target: Landing, name: str) -> int:
    """One file of the memory area into ``target``: a whole one with direct writes from a
    private mapping of it (writable, so the writer can hand its pages to the device; never
    written), a sparse one range by range. Returns the bytes copied."""
    target.delete(name)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        spans = _extents(fd, size) if size else []
        if spans != [(0, size)]:
            return _copy_sparse(fd, target.root / name, size, spans)
        out = target.open_writer(name, size)
        try:
            with mmap.mmap(fd, size, access=mmap.ACCESS_COPY) as mm:
                view = memoryview(mm)
                try:
                    out.write(view)
                finally:
                    view.release()
        except BaseException:
            out.abort()
            raise
        out.close()
        return size
    finally:
        os.close(fd)


def _copy_sparse(fd: int, path: Path, size: int, spans: list[tuple[int, int]]) -> int:
    path.parent.mkdir(exist_ok=True)  # a group directory
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    out = os.open(path, flags, 0o644)
    try:
        os.ftruncate(out, size)
        for a, b in spans:
            for pos in range(a, b, 16 << 20):
                data = memoryview(os.pread(fd, min(16 << 20, b - pos), pos))
                at = pos
                while data:
                    n = os.pwrite(out, data, at)
                    data, at = data[n:], at + n
    finally:
        os.close(out)
    return sum(b - a for a, b in spans)


def wipe(where: Path | None) -> None:
    """Remove a memory area and what it holds (a missing one is fine; one in a directory not
    this user's alone is left alone)."""
    if where is not None and _private(where.parent, create=False):
        shutil.rmtree(where, ignore_errors=True)
