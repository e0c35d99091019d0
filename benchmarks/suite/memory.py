"""Host memory of a process and its children (writer subprocesses count too).

The figure is ``sum(RssAnon) + max(RssShmem)`` over the process and its descendants, read from
``/proc/<pid>/status``: anonymous memory (staging buffers, copies) of every process, plus
shared memory counted once (a shared-memory staging area is mapped both by the trainer and by a
writer process, and is one copy). File pages (the page cache, mmap-ed checkpoint files) are not
counted: they are the kernel's to reclaim.

A child that has been forked but has not yet run ``exec`` (``subprocess`` starting a writer
process: a ``vfork`` shares the parent's address space, a ``fork`` its pages copy-on-write) shows
the parent's whole ``RssAnon`` as its own for that moment, though it holds no memory of its own.
It is recognised by its command line, still its parent's, and not counted. (A long-lived fork
that never execs and writes to its memory would be undercounted; no method measured here makes
one.) Counting such a child is what made the process writer's start look like a second copy of
a 4 GB state in a run of 2026-12-02 (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


def _status(pid: int) -> tuple[int, int] | None:
    """(RssAnon, RssShmem) in bytes, or None if the process is gone."""
    anon = shm = 0
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("RssAnon:"):
            anon = int(line.split()[1]) * 1024
        elif line.startswith("RssShmem:"):
            shm = int(line.split()[1]) * 1024
    return anon, shm


def _cmdline(pid: int) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (through /proc/<pid>/task/*/children), except children that
    are forks not yet turned into another program (see the module doc)."""
    out: list[int] = []
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            tasks = list(Path(f"/proc/{p}/task").iterdir())
        except OSError:
            continue
        own = _cmdline(p)
        for t in tasks:
            try:
                kids = (t / "children").read_text().split()
            except OSError:
                continue
            for k in map(int, kids):
                if own is not None and _cmdline(k) == own:
                    continue  # forked, not yet exec'd: the parent's memory, not its own
                out.append(k)
                stack.append(k)
    return out


def tree_detail(pid: int | None = None) -> list[tuple[int, int, int]]:
    """``(pid, RssAnon, RssShmem)`` of ``pid`` (default: this process) and each descendant."""
    root = os.getpid() if pid is None else pid
    out = []
    for p in [root, *_children(root)]:
        st = _status(p)
        if st is not None:
            out.append((p, *st))
    return out


def total(detail: list[tuple[int, int, int]]) -> int:
    """``sum(RssAnon) + max(RssShmem)`` of a :func:`tree_detail`."""
    return sum(a for _, a, _ in detail) + max((s for _, _, s in detail), default=0)


def tree_memory(pid: int | None = None) -> int:
    """``sum(RssAnon) + max(RssShmem)`` of ``pid`` (default: this process) and its descendants."""
    return total(tree_detail(pid))


class MemoryMonitor:
    """Samples :func:`tree_memory` every ``interval`` seconds in a daemon thread; keeps the peak,
    and at the peak each process's anonymous and shared memory (``peak_detail``: which process
    and which kind of memory made it)."""

    def __init__(self, interval: float = 0.02) -> None:
        self._interval = interval
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.peak_detail = tree_detail()
        self.peak = total(self.peak_detail)
        self.peak_at = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self._thread.start()

    def now(self) -> int:
        return tree_memory()

    def _sample(self) -> int:
        detail = tree_detail()
        m = total(detail)
        with self._lock:
            if m > self.peak:
                self.peak, self.peak_detail, self.peak_at = m, detail, time.perf_counter()
        return m

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self._interval)

    def reset(self) -> int:
        """Start a new peak from the current figure; returns that figure."""
        detail = tree_detail()
        with self._lock:
            self.peak, self.peak_detail, self.peak_at = total(detail), detail, time.perf_counter()
            return self.peak

    def peak_since_reset(self) -> int:
        self._sample()
        with self._lock:
            return self.peak

    def describe_peak(self) -> list[dict[str, float]]:
        """The processes at the peak: ``{"pid", "anon_gb", "shmem_gb"}`` each (GB, 1e9 bytes)."""
        with self._lock:
            return [{"pid": p, "anon_gb": a / 1e9, "shmem_gb": s / 1e9} for p, a, s in self.peak_detail]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)
