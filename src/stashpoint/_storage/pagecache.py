"""The newest checkpoint kept in the page cache, for a restart on the same node.

Shards are written with direct I/O, so after a save nothing of them is cached, while a
``torch.save`` or DCP checkpoint written through the page cache is: a process restarted on the
same node after a crash would read stashpoint's files from the disk and theirs from memory. So
after a save commits, each rank asks the kernel to read its own new files back in the background
(``POSIX_FADV_WILLNEED``), within a share of the memory available, and lets the files of the
save it cached before in the same run directory go (``POSIX_FADV_DONTNEED``). A load then reads
the cached part of each range, as ``mincore`` reports it, with buffered reads (small gaps in it
too), and only the rest directly (:func:`read_resident`).

Imports no torch: the writer process shares this package's I/O code.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import os
import platform
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from stashpoint._storage import fdtrack
from stashpoint._storage.directio import drop_front, libc_calls

log = logging.getLogger("stashpoint")

CACHE_SHARE = 0.5  # of MemAvailable, split between the node's ranks: what one rank's files may take
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


class _Kept:
    """Per run directory, the files this process last asked the kernel to keep."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.files: dict[Path, list[Path]] = {}


#: Directories whose newest checkpoint is kept (runs, or checkpoints saved each into a directory
#: of its own): beyond them the least recently saved one's files are dropped and forgotten.
_MAX_RUNS = 8


def _kept() -> _Kept:
    from stashpoint import _runtime

    return _runtime.slot("storage.page_cache", _Kept)


def mem_available() -> int | None:
    """The kernel's estimate of memory available without swapping, in bytes (None if unknown)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _local_ranks() -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


_STEP = 8 << 20  # one WILLNEED reads at most the device's read-ahead window: ask in steps


def _advise(paths: Sequence[Path], advice: int) -> None:
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError:  # removed since (retention), or never there: nothing to advise
            continue
        fdtrack.track(fd)
        try:
            if advice == os.POSIX_FADV_WILLNEED:
                size = os.fstat(fd).st_size
                for start in range(0, size, _STEP):
                    os.posix_fadvise(fd, start, min(_STEP, size - start), advice)
            else:
                os.posix_fadvise(fd, 0, 0, advice)
        except OSError:
            pass
        finally:
            fdtrack.close(fd)


def keep_cached(checkpoint: Path, paths: Sequence[Path], *, beside: int | None = None) -> bool:
    """Read ``paths`` (files of the checkpoint directory ``checkpoint``) into the page cache in
    the background, dropping what this process kept for an older checkpoint beside it. Files
    asked for before in the same checkpoint stay kept (a node's leader keeps its own files and
    the replicas it holds of other nodes').

    Returns whether the files were asked for: not when they exceed this rank's share of the
    available memory (``CACHE_SHARE`` of MemAvailable over ``LOCAL_WORLD_SIZE``), or off Linux.
    With ``beside``, the files are kept for the node (the replicas its leader holds) beside
    that many bytes of the node's own files of the checkpoint, and together they must fit in
    ``CACHE_SHARE`` of it: a replica, read only when another node is lost, must not push out
    the files a restart here reads first.
    """
    if not hasattr(os, "posix_fadvise") or not paths:
        return False
    sizes = 0
    for p in paths:
        try:
            sizes += p.stat().st_size
        except OSError:
            return False
    avail = mem_available()
    share = None if avail is None else avail * CACHE_SHARE
    if share is None or sizes > (share / _local_ranks() if beside is None else share - beside):
        log.debug("stashpoint: %s not kept in the page cache (%d bytes, %s available)", checkpoint, sizes, avail)
        return False
    run, kept = checkpoint.parent, _kept()
    with kept.lock:
        held = kept.files.pop(run, [])
        older = [p for p in held if checkpoint not in p.parents]
        kept.files[run] = list(dict.fromkeys([p for p in held if checkpoint in p.parents] + list(paths)))
        while len(kept.files) > _MAX_RUNS:  # checkpoints saved each into a directory of its own
            older += kept.files.pop(next(iter(kept.files)))  # the least recently saved beside

    def work() -> None:  # on a thread: WILLNEED submits reads and may wait for the disk's queue
        _advise(older, os.POSIX_FADV_DONTNEED)
        _advise(paths, os.POSIX_FADV_WILLNEED)

    threading.Thread(target=work, name="stashpoint-cache", daemon=True).start()
    return True


def read_resident(fd: int, offset: int, buffers: list[memoryview]) -> int:
    """Fill the front of ``buffers`` with what the page cache holds of ``fd`` (a buffered
    descriptor) from ``offset`` on, reading from the disk only small gaps: the bytes filled (0
    when the range starts with a run of pages that are not cached).

    ``mincore`` tells, ``_PROBE_BYTES`` at a time, which pages are cached. Cached runs, and gaps
    of at most ``_GAP_BYTES`` between cached pages (the kernel's read-back leaves 0.1-0.2% of
    a checkpoint's pages out, scattered), are read with ordinary reads; a longer run of pages
    that are not cached is where the disk's part begins. A non-blocking read
    (``RWF_NOWAIT``) alone was not enough: it stops at any page busy for a moment, and at
    each gap, and the rest of a 64 MiB read then came from the disk (up to 400 of a cached
    checkpoint's 660 MB); and where it stops it starts the kernel's read-ahead, which a check
    after it would take for cached pages. It is the way where ``mincore`` cannot be asked."""
    filled, pending = 0, buffers
    size = _trusted_size(fd)
    while pending:
        left = sum(len(b) for b in pending)
        run = _page_run(fd, offset + filled, left, size) if size is not None else None
        if run is None:
            return filled + _read_nowait(fd, offset + filled, pending)
        cached, n = run
        if not cached and (n > _GAP_BYTES or n >= left):
            break  # the disk's part: read directly by the caller
        try:
            got = os.preadv(fd, _front(pending[:512], n), offset + filled)
        except OSError:
            break  # the caller's direct or buffered read decides
        if got <= 0:
            break
        filled += got
        pending = drop_front(pending, got)
    return filled


def resident_at(fd: int, offset: int) -> bool:
    """Whether the page cache holds the page of ``fd`` at ``offset`` (False where ``mincore``
    cannot be asked)."""
    size = _trusted_size(fd)
    return size is not None and 0 <= offset < size and _page_cached(fd, offset, size)


def _page_cached(fd: int, offset: int, size: int) -> bool:
    """Whether the page at ``offset`` is cached: ``cachestat``'s yes is taken, its no is asked
    again of ``mincore`` (on overlayfs cachestat counts the overlay's own empty cache, while
    a mapping reaches the real file's): both in ``_page_run``."""
    run = _page_run(fd, offset, 1, size)
    return run is not None and run[0]


_SAMPLES = 16  # pages asked about per range by resident_sampled


def resident_sampled(fd: int, offset: int, length: int) -> bool:
    """Whether the page cache holds the range, as far as ``_SAMPLES`` pages spread over it
    (its first and last among them) show. Asking about every page walks them one by one, in
    the kernel too (0.5 ms per 64 MiB of small pages, a tenth of a cached load's reads): a
    range cached in part (the read-back stopped half-way, a file never read back) is found,
    and the few scattered pages a read-back leaves out then come from the disk, through the
    cache, as they would from the direct path (which reads small gaps buffered)."""
    size = _trusted_size(fd)
    if size is None or length <= 0 or offset + length > size:
        return False
    step = max(_PAGE, length // _SAMPLES)
    return all(_page_cached(fd, pos, size) for pos in (*range(offset, offset + length, step), offset + length - 1))


def _read_nowait(fd: int, offset: int, buffers: list[memoryview]) -> int:
    """The front of ``buffers`` filled by non-blocking reads, up to the first page they refuse."""
    if not _NOWAIT:
        return 0
    filled, pending = 0, buffers
    while pending:
        try:
            n = os.preadv(fd, pending[:512], offset + filled, _NOWAIT)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EOPNOTSUPP, errno.EINVAL):
                break  # not resident (or no non-blocking reads here): the rest comes from the disk
            raise
        if n <= 0:
            break
        filled += n
        pending = drop_front(pending, n)
    return filled


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


# cachestat(2), Linux 6.5+: 451 in the unified syscall table these architectures share
_CACHESTAT_ARCHS = ("x86_64", "aarch64", "ppc64le", "s390x", "riscv64")
_CACHESTAT = 451 if sys.platform.startswith("linux") and platform.machine() in _CACHESTAT_ARCHS else None
_cachestat_missing = False  # the kernel has no cachestat, or a filter (seccomp) refuses it


@functools.cache
def _gil_held_libc() -> ctypes.PyDLL | None:
    """libc for calls of a few microseconds made while reader threads run: they keep the GIL
    (a ``CDLL`` call gives it up and may then wait a switch interval, 5 ms, to get it back)."""
    libc = libc_calls()
    try:
        return None if libc is None else ctypes.PyDLL(libc._name, use_errno=True)
    except OSError:
        return None


def _all_cached(fd: int, offset: int, length: int) -> bool | None:
    """Whether the page cache holds every page of the range, by one ``cachestat``: a count the
    kernel keeps per range, where ``mincore`` answers page by page (4 us against 0.9 ms for
    64 MiB here, a tenth of a cached load's reads in all). None where it cannot be asked."""
    global _cachestat_missing
    libc = _gil_held_libc()
    if libc is None or _CACHESTAT is None or _cachestat_missing:
        return None
    got = _CacheStat()
    rc = libc.syscall(
        ctypes.c_long(_CACHESTAT),
        ctypes.c_int(fd),
        ctypes.byref(_Range(offset, length)),
        ctypes.byref(got),
        ctypes.c_uint(0),
    )
    if rc != 0:
        # an older kernel, or a filter's refusal (a file this process may not ask about is
        # turned away before, by _trusted_size): mincore from now on
        _cachestat_missing = ctypes.get_errno() in (errno.ENOSYS, errno.EPERM)
        return None
    return bool(got.cache >= (offset + length - 1) // _PAGE - offset // _PAGE + 1)


def _trusted_size(fd: int) -> int | None:
    """The size of ``fd``'s file if ``mincore`` can be asked about it, else None. The kernel
    answers truly only for a file this process owns or may write: for others it says every
    page is cached."""
    if libc_calls() is None:
        return None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() and not os.access(f"/proc/self/fd/{fd}", os.W_OK, effective_ids=True):
        return None
    return st.st_size


def _page_run(fd: int, offset: int, limit: int, size: int, probe: int = 0) -> tuple[bool, int] | None:
    """Whether the page at ``offset`` of ``fd`` (a file of ``size`` bytes that
    :func:`_trusted_size` cleared) is cached, and how many bytes from ``offset`` (at most
    ``limit`` and ``probe``, by default ``_PROBE_BYTES``) lie in pages that are alike, by
    ``mincore`` on a mapping never touched; None where that cannot be asked."""
    libc = libc_calls()
    if libc is None or limit <= 0:
        return None
    start = offset - offset % _PAGE
    end = min(offset + min(limit, probe or _PROBE_BYTES), size)
    length = end - start
    if length <= offset - start:
        return None
    if _all_cached(fd, offset, end - offset):  # the common answer, without a page-by-page walk
        return True, min(-(-end // _PAGE) * _PAGE, offset + limit) - offset
    pages = -(-length // _PAGE)
    addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        return None
    try:
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(addr), length, vec) != 0:
            return None
    finally:
        libc.munmap(ctypes.c_void_p(addr), length)
    flags = bytes(vec).translate(_LOW_BIT)  # 1 per cached page (the other bits are reserved)
    cached = flags[0] == 1
    run = flags.find(b"\0" if cached else b"\1")
    return cached, min(start + (pages if run < 0 else run) * _PAGE, offset + limit) - offset


_PAGE = mmap.PAGESIZE
_PROBE_BYTES = 4 << 20  # what one check covers (1024 pages)
_GAP_BYTES = 256 << 10  # the longest run of uncached pages among cached ones read with them
_LOW_BIT = bytes(i & 1 for i in range(256))


def _front(buffers: list[memoryview], n: int) -> list[memoryview]:
    """The first ``n`` bytes of ``buffers``."""
    out = []
    for b in buffers:
        if n <= 0:
            break
        out.append(b[:n])
        n -= len(out[-1])
    return out
