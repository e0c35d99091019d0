"""Host memory of a process and its children (writer subprocesses count too).

The figure is ``sum(RssAnon) + max(RssShmem)`` over the process and its descendants, read from
``/proc/<pid>/status``: anonymous memory (staging buffers, copies) of every process, plus
shared memory counted once (a shared-memory staging area is mapped both by the trainer and by a
writer process, and is one copy). File pages (the page cache, mmap-ed checkpoint files) are not
counted: they are the kernel's to reclaim.
"""

from __future__ import annotations

import os
import threading
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


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (through /proc/<pid>/task/*/children)."""
    out: list[int] = []
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            tasks = list(Path(f"/proc/{p}/task").iterdir())
        except OSError:
            continue
        for t in tasks:
            try:
                kids = (t / "children").read_text().split()
            except OSError:
                continue
            for k in kids:
                out.append(int(k))
                stack.append(int(k))
    return out


def tree_memory(pid: int | None = None) -> int:
    """``sum(RssAnon) + max(RssShmem)`` of ``pid`` (default: this process) and its descendants."""
    root = os.getpid() if pid is None else pid
    anon = shm = 0
    for p in [root, *_children(root)]:
        st = _status(p)
        if st is not None:
            anon += st[0]
            shm = max(shm, st[1])
    return anon + shm


class MemoryMonitor:
    """Samples :func:`tree_memory` every ``interval`` seconds in a daemon thread; keeps the peak."""

    def __init__(self, interval: float = 0.02) -> None:
        self._interval = interval
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.peak = tree_memory()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self._thread.start()

    def now(self) -> int:
        return tree_memory()

    def _run(self) -> None:
        while not self._stop.is_set():
            m = tree_memory()
            with self._lock:
                self.peak = max(self.peak, m)
            self._stop.wait(self._interval)

    def reset(self) -> int:
        """Start a new peak from the current figure; returns that figure."""
        m = tree_memory()
        with self._lock:
            self.peak = m
        return m

    def peak_since_reset(self) -> int:
        m = tree_memory()
        with self._lock:
            self.peak = max(self.peak, m)
            return self.peak

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)
