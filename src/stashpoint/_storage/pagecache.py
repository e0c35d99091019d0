"""The newest checkpoint kept in the page cache, for a restart on the same node.

Shards are written with direct I/O, so after a save nothing of them is cached, while a
``torch.save`` or DCP checkpoint written through the page cache is: a process restarted on the
same node after a crash would read stashpoint's files from the disk and theirs from memory. So
after a save commits, each rank asks the kernel to read its own new files back in the background
(``POSIX_FADV_WILLNEED``), within a share of the memory available, and lets the files of the
save it cached before in the same run directory go (``POSIX_FADV_DONTNEED``). A load then takes
the cached part of each range with a non-blocking buffered read (``RWF_NOWAIT``: whatever is
resident, never waiting for the disk) and reads only the rest directly.

Imports no torch: the writer process shares this package's I/O code.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger("stashpoint")

CACHE_SHARE = 0.5  # of MemAvailable, split between the node's ranks: what one rank's files may take
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


class _Kept:
    """Per run directory, the files this process last asked the kernel to keep."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.files: dict[Path, list[Path]] = {}


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
            os.close(fd)


def keep_cached(checkpoint: Path, paths: Sequence[Path]) -> bool:
    """Read ``paths`` (files of the checkpoint directory ``checkpoint``) into the page cache in
    the background, dropping what this process kept for an older checkpoint beside it.

    Returns whether the files were asked for: not when they exceed this rank's share of the
    available memory (``CACHE_SHARE`` of MemAvailable over ``LOCAL_WORLD_SIZE``), or off Linux.
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
    if avail is None or sizes > avail * CACHE_SHARE / _local_ranks():
        log.debug("stashpoint: %s not kept in the page cache (%d bytes, %s available)", checkpoint, sizes, avail)
        return False
    run, kept = checkpoint.parent, _kept()
    with kept.lock:
        older = [p for p in kept.files.get(run, []) if checkpoint not in p.parents]
        kept.files[run] = list(paths)

    def work() -> None:  # on a thread: WILLNEED submits reads and may wait for the disk's queue
        _advise(older, os.POSIX_FADV_DONTNEED)
        _advise(paths, os.POSIX_FADV_WILLNEED)

    threading.Thread(target=work, name="stashpoint-cache", daemon=True).start()
    return True


def read_resident(fd: int, offset: int, buffers: list[memoryview]) -> int:
    """Fill the front of ``buffers`` from the page cache of the buffered descriptor ``fd``,
    without waiting for the disk: the bytes filled (0 when the first page is not resident)."""
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
