"""Direct-I/O reads into memory of any alignment, through reused aligned bounce buffers.

``O_DIRECT`` reads need an aligned file offset, length and memory address; the tensors a load
fills are aligned to 64 bytes at best. So a large read is done in aligned pieces into a
page-aligned bounce buffer, and each piece is copied (``memmove``, without the GIL) into the
destination buffers: a file written with direct I/O is not in the page cache, and reading it
directly beats the small read-ahead requests of a buffered read by far more than the copy out
of the bounce buffer costs (figures: benchmarks/RESULTS.md, "Loads"). Destinations that are
page-aligned themselves, at page-aligned file positions (a transfer's stream buffers, a load's
arena and pinned slots), are read into as they are.

Imports no torch: the writer process shares this package's I/O code.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import mmap
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress

ALIGN = 4096  # file offsets, lengths and memory of O_DIRECT reads: a multiple of any block size in use
BOUNCE_BYTES = 16 * 1024 * 1024  # one bounce buffer: 4 MiB block requests, several in flight
MIN_DIRECT_BYTES = 1024 * 1024  # smaller reads stay buffered (headers, manifests, partial reads)
_MAX_IN_PLACE = 1 << 30  # one read into a destination (Linux returns at most 2 GiB - 4 KiB per read)
_MAX_IDLE = 8
_MAKING_WAIT_S = 10.0  # the longest a take waits for the buffers being made ahead


def address(mv: memoryview) -> int | None:
    """The address of a writable buffer's first byte (None for read-only or empty buffers)."""
    if mv.readonly or not len(mv):
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(mv))


class BouncePool:
    """Page-aligned buffers of ``nbytes``, reused: a storage object's bounce buffers (freed
    with it), or a process's transfer buffers.

    At most ``keep`` idle buffers are kept (a load's reader threads use one each); each is
    mapped with its pages populated (huge pages where allowed: :func:`huge_mapping`), so a
    direct read never faults them in one by one.
    """

    def __init__(self, nbytes: int = BOUNCE_BYTES, keep: int = _MAX_IDLE) -> None:
        self.nbytes = nbytes
        self.keep = keep
        self._idle: list[mmap.mmap] = []
        self._lock = threading.Condition()
        self._making = 0  # buffers being made ahead (``prepare``)

    def prepare(self, count: int) -> threading.Thread:
        """Make up to ``count`` buffers on a thread (no more than the pool keeps idle), each
        given to the pool as soon as it is made. A ``take`` meanwhile waits for them rather
        than making one of its own: two buffers populated at once wait for the kernel's
        compaction in turn, and the one taken would be ready no sooner (0.19 s for one 16 MiB
        buffer seen in a restarted node's first transfer)."""
        if count < 0:
            raise ValueError(f"count must be at least 0, got {count}")
        with self._lock:
            count = max(0, min(count, self.keep - len(self._idle) - self._making))
            self._making += count

        def make() -> None:
            made = 0
            try:
                for _ in range(count):
                    buf = huge_mapping(self.nbytes)
                    with self._lock:
                        self._making -= 1
                        made += 1
                        self._idle.append(buf)
                        self._lock.notify()
            except OSError:  # no memory now: each take makes its own
                pass
            finally:
                done(count - made)

        def done(unmade: int) -> None:
            with self._lock:
                self._making -= unmade
                self._lock.notify_all()

        thread = threading.Thread(target=make, name="stashpoint-buffers", daemon=True)
        try:
            thread.start()
        except BaseException:  # no thread (the interpreter shutting down): no take waits for it
            done(count)
            raise
        return thread

    def take(self) -> mmap.mmap:
        with self._lock:  # bounded: a maker stuck in the kernel's compaction is not waited for long
            self._lock.wait_for(lambda: self._idle or not self._making, timeout=_MAKING_WAIT_S)
            buf = self._idle.pop() if self._idle else None
        return huge_mapping(self.nbytes) if buf is None else buf

    def give(self, buf: mmap.mmap) -> None:
        """Return ``buf``, which nothing reads or writes any more."""
        with self._lock:
            if len(self._idle) < self.keep:
                self._idle.append(buf)
                self._lock.notify()
                return
        with suppress(BufferError):  # a view still held (an error's traceback): freed later
            buf.close()

    @contextmanager
    def buffer(self) -> Iterator[mmap.mmap]:
        buf = self.take()
        try:
            yield buf
        finally:
            self.give(buf)


POPULATE_WRITE = 23  # MADV_POPULATE_WRITE (Linux 5.14)


def huge_mapping(nbytes: int, populate: bool = True) -> mmap.mmap:
    """``nbytes`` of private anonymous memory, page-aligned, backed by huge pages where the
    kernel allows it (``MADV_HUGEPAGE``) and, with ``populate``, faulted in now. A direct read
    or write pins its buffer's pages for each request: a few huge pages cost far less than
    thousands of small ones (figures: RESULTS.md, "Huge pages for direct I/O"). For buffers
    kept and reused: a large mapping made for each use pays the kernel's compaction every time
    (an atomic load's arena was slower with huge pages)."""
    huge = hasattr(mmap, "MADV_HUGEPAGE")
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if populate and not huge:
        flags |= getattr(mmap, "MAP_POPULATE", 0)
    buf = mmap.mmap(-1, nbytes, flags=flags)
    if huge:
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
        if populate:
            try:
                _madvise(buf, getattr(mmap, "MADV_POPULATE_WRITE", POPULATE_WRITE))
            except OSError as e:  # EINVAL: an older kernel, so touch each page; else (ENOMEM)
                # leave the faults to the first use, as MAP_POPULATE would
                if e.errno == errno.EINVAL:
                    for at in range(0, nbytes, mmap.PAGESIZE):
                        buf[at] = 0
    return buf


def _madvise(buf: mmap.mmap, advice: int) -> None:
    """``buf.madvise(advice)`` through libc, so that the kernel's work runs without the GIL:
    populating huge pages may wait for the kernel to compact memory (35 ms per 16 MiB seen),
    and ``mmap.madvise`` holds the GIL throughout, stopping every other thread."""
    libc = libc_calls()
    if libc is None:
        buf.madvise(advice)
        return
    view = memoryview(buf)
    try:
        addr = address(view)
    finally:
        view.release()
    if addr is None or libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(len(buf)), advice) != 0:
        err = ctypes.get_errno() if addr is not None else errno.EINVAL
        raise OSError(err, os.strerror(err))


@functools.cache
def libc_calls() -> ctypes.CDLL | None:
    """libc, for the memory calls Python's ``mmap`` lacks or makes while holding the GIL
    (``madvise``, and ``mincore`` on a mapping of its own for the page cache); None where it
    cannot be loaded."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


def _scatter(src: memoryview, src_addr: int, dests: list[memoryview]) -> None:
    """Copy ``src`` into the front of ``dests`` (writable) in order, dropping what was filled."""
    pos = 0
    while pos < len(src) and dests:
        d = dests[0]
        n = min(len(d), len(src) - pos)
        addr = address(d)
        assert addr is not None  # checked writable by readv_direct
        ctypes.memmove(addr, src_addr + pos, n)  # releases the GIL
        pos += n
        if n == len(d):
            dests.pop(0)
        else:
            dests[0] = d[n:]


def _aligned_run(dests: list[memoryview], pos: int, at: int) -> memoryview | None:
    """The front of the next destination when it can be read into as it is: its address and
    the file position page-aligned, nothing skipped before it, at least a page long."""
    if not dests or pos != at or pos % ALIGN or len(dests[0]) < ALIGN:
        return None
    addr = address(dests[0])
    if addr is None or addr % ALIGN:
        return None
    return dests[0][: min(len(dests[0]), _MAX_IN_PLACE) // ALIGN * ALIGN]


def drop_front(buffers: list[memoryview], n: int) -> list[memoryview]:
    """``buffers`` without their first ``n`` bytes (a partly filled buffer keeps its rest)."""
    out = list(buffers)
    while n and out:
        if n >= len(out[0]):
            n -= len(out.pop(0))
        else:
            out[0] = out[0][n:]
            n = 0
    return out


def readv_direct(fd: int, offset: int, buffers: Sequence[memoryview], pool: BouncePool) -> int:
    """Fill ``buffers`` (writable) in order from ``offset`` of the ``O_DIRECT`` descriptor ``fd``.

    Returns the number of bytes filled, from the front: less than asked when a read came back
    short (the end of the file, or a file system that returns short direct reads); the caller
    reads the rest buffered, which tells the two apart. An ``OSError`` (EINVAL: the file system
    refuses this alignment) may come after some buffers were filled; the caller then reads the
    whole range again, buffered.
    """
    dests = [b.cast("B") for b in buffers if len(b)]
    if any(d.readonly for d in dests):
        raise TypeError("readv_direct: every buffer must be writable")
    total = sum(len(b) for b in dests)
    end = offset + total
    pos = offset - offset % ALIGN  # aligned start; the bytes before ``offset`` are skipped
    filled = 0
    in_place = True
    with pool.buffer() as buf:
        mv = memoryview(buf)
        base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        try:
            while pos < end:
                whole = _aligned_run(dests, pos, offset + filled) if in_place else None
                if whole is not None:
                    try:
                        n = os.preadv(fd, [whole], pos)  # straight into the destination: no copy
                    except OSError as e:
                        if e.errno != errno.EFAULT:
                            raise
                        in_place = False  # memory the kernel cannot read into directly: bounce it
                        continue
                    filled += n
                    pos += n
                    dests[:] = drop_front(dests, n)
                    if n < len(whole):
                        break
                    continue
                want = min(len(mv), -(-(end - pos) // ALIGN) * ALIGN)
                n = os.preadv(fd, [mv[:want]], pos)
                skip = max(0, offset - pos)
                useful = max(0, min(n, end - pos) - skip)
                _scatter(mv[skip : skip + useful], base + skip, dests)
                filled += useful
                pos += n
                if n < want:  # short: the end of the file, or the rest is read buffered
                    break
        finally:
            mv.release()
    return filled
