"""One mapping for the host buffers of an atomic load, its pages populated ahead of the readers."""

from __future__ import annotations

import mmap
import threading
from typing import Any

import torch

from stashpoint._state.dtypes import as_memoryview


class Arena:
    """One mapping for the host buffers of a fetch's pieces, laid out in read order,
    its pages populated by a thread that keeps ahead of the readers: a fetch faults in as many
    fresh pages as it reads bytes, and this takes most of that work off the readers' path."""

    _POPULATE_WRITE = 23  # MADV_POPULATE_WRITE (Linux 5.14)
    _STEP = 32 << 20

    def __init__(self, pieces: list[Any]) -> None:  # pieces.Piece: their buf and mv are replaced
        mine = sorted((p for p in pieces if p.buf.device.type == "cpu"), key=lambda p: (p.chunk.file, p.chunk.start))
        sizes = [-(-p.buf.numel() * p.itemsize // 4096) * 4096 for p in mine]
        self.total = sum(sizes)
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        if self.total < self._STEP:
            return
        self.map = mmap.mmap(-1, self.total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(self.map, dtype=torch.uint8)
        at = 0
        for p, n in zip(mine, sizes):
            p.buf = whole[at : at + p.buf.numel() * p.itemsize].view(p.buf.dtype).view(p.buf.shape)
            p.mv = as_memoryview(p.buf)
            at += n
        self.thread = threading.Thread(target=self._populate, name="stashpoint-populate", daemon=True)

    def _populate(self) -> None:
        for off in range(0, self.total, self._STEP):
            if self.stop.is_set():
                return
            try:
                self.map.madvise(self._POPULATE_WRITE, off, min(self._STEP, self.total - off))
            except (OSError, ValueError):  # an older kernel: the readers fault the pages in
                return

    def __enter__(self) -> Arena:
        if self.thread is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
