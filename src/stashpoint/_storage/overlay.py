"""A read-only view of one checkpoint kept in two places: each file read from ``top`` where it
is there, else from ``base``. A node-local restore lands what it fetches in memory the node's
processes share (``top``) over the node's directory (``base``) and loads through this view."""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from typing import NoReturn

from stashpoint._storage.base import FileWriter, Storage
from stashpoint.errors import CheckpointError


class Overlay(Storage):
    """``top`` over ``base``, for reads. A name is looked up in ``top`` at each call (files may
    land there meanwhile: a transfer passes on what it received in the same pass)."""

    def __init__(self, top: Storage, base: Storage) -> None:
        self.top = top
        self.base = base
        self.local_reads = top.local_reads and base.local_reads

    @property
    def location(self) -> str:
        return self.base.location

    def _of(self, name: str) -> Storage:
        return self.top if self.top.exists(name) else self.base

    def read(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        return self._of(name).read(name, offset, length)

    def readv(self, name: str, offset: int, buffers: Sequence[memoryview]) -> None:
        self._of(name).readv(name, offset, buffers)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self._of(name).read_into(name, offset, out)

    def size(self, name: str) -> int:
        return self._of(name).size(name)

    def exists(self, name: str | None = None) -> bool:
        if name is None:
            return self.base.exists() or self.top.exists()
        return self.top.exists(name) or self.base.exists(name)

    def list(self) -> builtins.list[str]:
        return sorted(set(self.top.list()) | set(self.base.list()))

    def cached(self, name: str, offset: int) -> bool:
        return self._of(name).cached(name, offset)

    def reads_for(self, name: str, offset: int, length: int) -> Storage:
        return self._of(name).reads_for(name, offset, length)

    def shared_reads(self) -> Storage:
        return Overlay(self.top.shared_reads(), self.base.shared_reads())

    def _read_only(self, what: str) -> NoReturn:
        raise CheckpointError(f"{self.location} is read here through a view of two copies; it cannot {what}")

    def prepare(self) -> None:
        self._read_only("be prepared for writing")

    def open_writer(self, name: str, size: int) -> FileWriter:
        self._read_only(f"write {name!r}")

    def sync(self) -> None:
        self._read_only("sync")

    def commit(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        self._read_only(f"commit {name!r}")

    def delete(self, name: str) -> None:
        self._read_only(f"delete {name!r}")

    def child(self, name: str) -> Storage:
        self._read_only(f"have a sub-root {name!r}")

    def children(self) -> builtins.list[str]:
        return []

    def remove_tree(self) -> None:
        self._read_only("be removed")

    def move(self, name: str) -> Storage:
        self._read_only(f"be moved to {name!r}")
