"""The storage interface a checkpoint is written through, and the local-filesystem backend.

A :class:`Storage` is rooted at one checkpoint (a directory, or a prefix in an object store).
Call order during a save, on each rank:

1. ``prepare()`` — create the root if needed;
2. ``open_writer(name, size)`` per shard, ``write()`` its bytes in order, ``close()`` makes the
   file durable (or ``abort()`` removes it);
3. ``sync()`` — make the new files' names durable;
4. on the committing rank only, ``commit(MANIFEST_NAME, data, exclusive=...)`` — atomically
   publish the manifest; the checkpoint exists from that moment. ``exclusive``: fail with
   :class:`FileExistsError` if the name exists (of two concurrent saves, exactly one commits).

Loads use ``read``/``read_into`` (ranged), ``size``, ``exists`` and ``list``.

File names are plain names, or a plain name inside a *group directory* (``g00012/name``: in worlds
of more than 1,024 ranks each 1,024 ranks' files go in one, see docs/FORMAT.md). A backend
creates a group directory when a file is written into it, makes its entries durable in
``sync()``, and lists its files in ``list()`` as ``g00012/name``; it never treats one as a
sub-root (``children()``).

A run directory (the :class:`~stashpoint.CheckpointManager`'s root) is a storage too: its steps
are ``child(name)`` storages, listed by ``children()``, removed by ``remove_tree()`` and moved
aside by ``move()``.
"""

from __future__ import annotations

import abc
import builtins
import contextlib
import os
from collections.abc import Callable, Iterator, Sequence


class FileWriter(abc.ABC):
    """A file being written in order. ``close()`` returns once it is durable."""

    @abc.abstractmethod
    def write(self, data: memoryview | bytes) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    @abc.abstractmethod
    def abort(self) -> None: ...


class Storage(abc.ABC):
    """Where one checkpoint's files live. See the module docstring for the call order."""

    #: Whether ``commit`` is an atomic rename (True) or a write whose presence commits (False).
    atomic_rename: bool = True
    #: Whether a root exists on its own once ``prepare()`` made it (a directory: True), or only
    #: while it holds a file (an object-store prefix, where ``prepare()`` creates nothing: False).
    has_directories: bool = True
    #: How many files of one save to write at once (each ``open_writer`` file on a thread of its
    #: own); 1: one after the other.
    write_streams: int = 1

    @property
    @abc.abstractmethod
    def location(self) -> str:
        """A human-readable location, used in messages."""

    @abc.abstractmethod
    def prepare(self) -> None: ...

    @abc.abstractmethod
    def open_writer(self, name: str, size: int) -> FileWriter: ...

    @abc.abstractmethod
    def sync(self) -> None: ...

    @abc.abstractmethod
    def commit(self, name: str, data: bytes, *, exclusive: bool = False) -> None: ...

    @abc.abstractmethod
    def read(self, name: str, offset: int = 0, length: int | None = None) -> bytes: ...

    @abc.abstractmethod
    def readv(self, name: str, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` in order from the contiguous range starting at ``offset``.

        Raises :class:`EOFError` if the file ends first.
        """

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` from the file's bytes starting at ``offset``."""
        self.readv(name, offset, [out])

    @contextlib.contextmanager
    def reading(self, name: str) -> Iterator[Callable[[int, Sequence[memoryview]], None]]:
        """Several reads of ``name`` in a row, each ``readv(offset, buffers)`` as :meth:`readv`
        does it: a backend may keep the file open between them (by default each is a
        :meth:`readv`). The function yielded is valid inside the ``with`` block only (it may
        hold a descriptor closed at its end)."""
        yield lambda offset, buffers: self.readv(name, offset, buffers)

    @abc.abstractmethod
    def size(self, name: str) -> int: ...

    @abc.abstractmethod
    def exists(self, name: str | None = None) -> bool:
        """Whether the file ``name`` exists, or (``None``) whether the root exists."""

    @abc.abstractmethod
    def list(self) -> list[str]: ...

    def tree(self) -> builtins.list[str] | None:
        """Every file under this directory at any depth, as ``/``-separated names relative to
        it, whatever wrote them; None where the backend cannot tell (or there are too many to
        list). A crashed save's leftover is removed only when stashpoint wrote all of it."""
        return None

    def listed(self, name: str) -> bool:
        """Whether a listing names the file ``name``: asked beside :meth:`exists` before a
        directory without its manifest is taken for a leftover and deleted (an object store's
        listing and its HEAD are separate answers; one 404 of a HEAD costs no committed step)."""
        return name in self.list()

    def sizes(self) -> dict[str, int]:
        """The size of every file :meth:`list` names (a file removed meanwhile is left out); an
        object store answers from one listing instead of a request per file."""
        out = {}
        for name in self.list():
            try:
                out[name] = self.size(name)
            except FileNotFoundError:
                continue
        return out

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Delete the file ``name``; a missing file is fine."""

    #: reads of this backend are bound by the host's memory and cores (local files), not by a
    #: device's or a network's latency: a load reads with no more threads than the host has cores
    local_reads: bool = False

    def shared_reads(self) -> Storage:
        """This storage for reads that other processes on this host make too (ranks reading the
        same replicated tensors): a backend that bypasses a shared cache for its reads returns a
        copy that uses it."""
        return self

    def cached(self, name: str, offset: int) -> bool:
        """A hint for a reader: whether the host's cache holds the bytes of ``name`` at
        ``offset`` (then small reads cost nothing more than large ones; from a device or a
        network, large reads keep its queue full). False where it cannot be told."""
        return False

    def reads_for(self, name: str, offset: int, length: int) -> Storage:
        """The storage to read ``length`` bytes of ``name`` from ``offset`` through: this one,
        or a twin that reads them from the host's cache with plain reads, where the cache holds
        them (a sample of them may stand for all) and this backend's own reads would bypass it
        (direct I/O)."""
        return self

    def keep_cached(self, names: Sequence[str], *, beside: int | None = None) -> None:
        """A hint after a commit: this rank's files ``names`` of the newest checkpoint are the
        ones a restart on this host reads first; a backend with a host cache keeps them there.
        ``beside``: the files are kept for the node (the replicas its leader holds), beside
        that many bytes of the node's own files of the checkpoint."""
        return None

    def best_effort(self) -> Storage:
        """This storage for clean-up after a failure: the same files, but giving up quickly
        instead of retrying (a backend with long retries returns a copy with short ones)."""
        return self

    # -- the run-directory level ---------------------------------------------------------------

    @abc.abstractmethod
    def child(self, name: str) -> Storage:
        """The storage rooted at ``name`` under this root (same backend and options)."""

    @abc.abstractmethod
    def children(self) -> builtins.list[str]:
        """The names of the sub-roots directly under this root (directories, or common prefixes)."""

    @abc.abstractmethod
    def remove_tree(self) -> None:
        """Delete this root and everything under it; a missing root is fine."""

    @abc.abstractmethod
    def move(self, name: str) -> Storage:
        """Give this root the sibling name ``name`` and return the storage there. Object stores,
        which cannot rename, copy every object and then delete the originals."""


def env_number(name: str, default: float, low: float, high: float, scale: float = 1.0) -> float:
    """A number from environment variable ``name``, ``default`` when unset; a clear error when
    it is not a number in ``[low, high]`` (after ``scale``)."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw) * scale
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number; unset it or give e.g. {default / scale:g}") from None
    if not low <= value <= high:
        raise ValueError(f"{name}={raw!r} is out of range: it must be between {low / scale:g} and {high / scale:g}")
    return value
