"""The references every method is compared with, measured in the same run on the same disk.

* The raw disk bandwidth for the state's byte count: a direct-I/O (``O_DIRECT``) write + fsync
  and read of one file in 64 MiB aligned blocks (no page cache: the disk itself), and a
  buffered write + fsync (through the page cache: hot or cold, see ``ANCHORS.md``) and a
  buffered read after evicting the file's pages.
* The copy floor: one ``copy_`` of the whole state into already-touched, reused host buffers
  (the least a blocking stage can cost), and the same copy into fresh memory (first touch).
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path
from typing import Any

from .common import COLD_SLEEP_S, GB, log, median
from .state import live_tensors

BLOCK = 64 << 20
ALIGN = 4096


def _buffer() -> mmap.mmap:
    """A page-aligned 64 MiB buffer of non-zero, incompressible-looking bytes."""
    buf = mmap.mmap(-1, BLOCK)
    pattern = os.urandom(1 << 20)
    for off in range(0, BLOCK, len(pattern)):
        buf[off : off + len(pattern)] = pattern
    return buf


def _write(path: Path, nbytes: int, buf: mmap.mmap, direct: bool) -> float:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    t0 = time.perf_counter()
    fd = os.open(path, flags, 0o644)
    view = memoryview(buf)
    try:
        left = nbytes
        while left > 0:
            n = min(BLOCK, left)
            done = os.write(fd, view[:n])
            if done != n:
                raise OSError(f"short write to {path}: {done} of {n} bytes")
            left -= n
        os.fsync(fd)
    finally:
        view.release()  # else a failure's traceback holds it, and closing ``buf`` raises BufferError
        os.close(fd)
    return time.perf_counter() - t0


def _read(path: Path, buf: mmap.mmap, direct: bool) -> float:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    t0 = time.perf_counter()
    try:
        while os.readv(fd, [buf]) > 0:
            pass
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class Paired:
    """The disk's speed next to each measured save and load (the machine's disk speed swings by
    2x within minutes here): a direct-I/O write + fsync, or a read, of ``nbytes`` (this rank's
    share of the state) into ``root``, made by every rank at once right after a save or a load;
    on the same node, a read of ``load_nbytes`` from the page cache (what a load of the rank reads)."""

    def __init__(self, root: Path, rank: int, nbytes: int, load_nbytes: int | None = None) -> None:
        self.file = root / f"paired-raw-{rank}.bin"
        self.nbytes = -(-nbytes // ALIGN) * ALIGN
        # what a load of this rank reads: more than its share where every rank needs the whole
        # state (DDP), each rank copying all of it from the page cache on the same node
        self.load_nbytes = -(-(load_nbytes or nbytes) // ALIGN) * ALIGN
        self.buf = _buffer()

    def write(self) -> float:
        self.file.parent.mkdir(parents=True, exist_ok=True)
        return _write(self.file, self.nbytes, self.buf, direct=True)

    def read(self) -> float:
        """Read back the last :meth:`write` (never cached: it was written with direct I/O)."""
        return _read(self.file, self.buf, direct=True)

    def cache(self) -> None:
        """Write the file (as many bytes as a load of this rank reads) through the page cache
        and read it once: :meth:`read_cached` then reads it from memory, as a same-node load
        finds a checkpoint's pages."""
        self.file.parent.mkdir(parents=True, exist_ok=True)
        _write(self.file, self.load_nbytes, self.buf, direct=False)  # fsynced: no writeback during the loads
        _read(self.file, self.buf, direct=False)

    def read_cached(self) -> float:
        """A buffered read of the file (cached by :meth:`cache`)."""
        return _read(self.file, self.buf, direct=False)

    def close(self) -> None:
        self.buf.close()
        self.file.unlink(missing_ok=True)


def raw_bandwidth(
    root: Path, nbytes: int, regime: str, repeats: int, cold_sleep: float = COLD_SLEEP_S
) -> dict[str, Any]:
    """GB/s of direct-I/O and buffered writes and reads of ``nbytes`` under ``root`` (see the module doc).

    The buffered write runs in ``regime``: ``cold`` waits ``cold_sleep`` seconds after the
    previous file was deleted, ``hot`` does not.
    """
    nbytes = -(-nbytes // ALIGN) * ALIGN
    root.mkdir(parents=True, exist_ok=True)
    buf = _buffer()
    f = root / "raw.bin"
    times: dict[str, list[float]] = {k: [] for k in ("direct_write", "direct_read", "buffered_write", "buffered_read")}
    try:
        _write(f, nbytes, buf, direct=False)  # warm-up: the file system's first allocation, unmeasured
        f.unlink()
        for i in range(repeats):
            if regime == "cold":
                time.sleep(cold_sleep)
            times["buffered_write"].append(_write(f, nbytes, buf, direct=False))
            _evict(f)
            times["buffered_read"].append(_read(f, buf, direct=False))
            f.unlink()
            times["direct_write"].append(_write(f, nbytes, buf, direct=True))
            times["direct_read"].append(_read(f, buf, direct=True))
            f.unlink()
            log(
                f"raw disk {i + 1}/{repeats}: "
                + ", ".join(f"{k} {nbytes / t[-1] / GB:.2f} GB/s" for k, t in times.items()),
                "disk",
            )
    finally:
        buf.close()
        if f.exists():
            f.unlink()
    out: dict[str, Any] = {"bytes": nbytes, "regime": regime, "cold_sleep_s": cold_sleep if regime == "cold" else 0}
    for k, ts in times.items():
        t = median(ts)
        out[f"{k}_s"] = t
        out[f"{k}_gbps"] = nbytes / t / GB if t else None
        out[f"all_{k}_s"] = ts
    return out


def copy_floor(state: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Seconds of one ``copy_`` of the state into reused buffers, and into fresh memory."""
    import torch

    src = [t.detach() for t in live_tensors(state)]
    nbytes = sum(t.numel() * t.element_size() for t in src)
    t0 = time.perf_counter()
    bufs = [torch.empty_like(t) for t in src]
    with torch.no_grad():
        for b, t in zip(bufs, src, strict=True):
            b.copy_(t)  # first touch of fresh memory
    first = time.perf_counter() - t0
    times = []
    for _ in range(max(repeats, 3)):
        t0 = time.perf_counter()
        with torch.no_grad():
            for b, t in zip(bufs, src, strict=True):
                b.copy_(t)
        times.append(time.perf_counter() - t0)
    if not all(torch.equal(b, t) for b, t in zip(bufs[:8], src[:8], strict=True)):
        raise RuntimeError("the floor's copy does not match its source")
    copy_s = median(times)
    return {
        "copy_s": copy_s,
        "gbps": nbytes / copy_s / GB if copy_s else None,
        "first_touch_copy_s": first,
        "all_copy_s": times,
    }
