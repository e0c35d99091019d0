"""The values of :mod:`.picklescan`'s shadow of the unpickler's stack and memo: what the scan
knows of a global, a list, a dict or set, a ``MetadataIndex``, a tuple, a hash; and the hashes
and identities of the keys it counts (:class:`_Identities`)."""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable
from typing import Any

#: A slice's hash from its items' (None before Python 3.12, where slices are unhashable).
_slice_hash: Callable[[tuple[Any, ...]], int] | None = (
    (lambda hs: hash(slice(*hs))) if sys.version_info >= (3, 12) else None
)


class _Global(str):
    """A global the pickle names, as ``"module name"``."""

    __slots__ = ()


class _List:
    __slots__ = ("items",)

    def __init__(self, items: list[Any]) -> None:
        self.items = items


class _Table:
    """A dict or set: its keys are counted as they are put in; ``n`` and ``cost`` (the steps that
    putting them in took: hashing, comparing with keys of one hash) for copies of it; the values
    of its keys in :data:`.picklescan._FIELDS`, for an object's state."""

    __slots__ = ("attrs", "cost", "n")

    def __init__(self, n: int = 0, cost: int = 0) -> None:
        self.n, self.cost = n, cost
        self.attrs: dict[str, Any] = {}


class _Record:
    """A ``MetadataIndex``: its attributes, as its constructor or BUILD set them."""

    __slots__ = ("attrs",)

    def __init__(self, attrs: dict[str, Any]) -> None:
        self.attrs = attrs


class _Tuple:
    """A tuple (or frozenset, ``items`` then empty): its hash and identity are found once, when
    first needed; its cost (steps to hash it) and depth when built."""

    __slots__ = ("cost", "depth", "h", "ident", "items", "what")

    def __init__(self, items: tuple[Any, ...], cost: int, depth: int, what: str = "tuples") -> None:
        self.items, self.cost, self.depth, self.what = items, cost, depth, what
        self.h = 0
        self.ident: int | None = -1  # -1: not found yet; None: unhashable


class _H:
    """Hashes as a value of hash ``h`` does: a tuple or frozenset of these hashes as the real one."""

    __slots__ = ("h",)

    def __init__(self, h: int) -> None:
        self.h = h

    def __hash__(self) -> int:
        return self.h


def _global(arg: str) -> _Global:
    """GLOBAL's ``"module name"``, with Python 2's name of builtins as unpicklers map it."""
    module, _, attr = arg.partition(" ")
    return _Global(f"{'builtins' if module == '__builtin__' else module} {attr}")


_OPAQUE = object()  # a value the shadow does not follow: never counted, unhashable for it


class _Identities:
    """The hash and identity of each value the shadow puts into a table: a small int, equal for
    equal values, found from keys whose hashes are seeded (str and bytes)."""

    def __init__(self) -> None:
        # one table per kind, keyed by str or bytes only
        self.strs: dict[str, int] = {}
        self.blobs: dict[bytes, int] = {}  # bytes values
        self.nums: dict[bytes, int] = {}  # numbers and None, by their bytes
        self.ids: dict[str, int] = {}  # tuples and frozensets, by their items' identities

    def _record_key(self, record: _Record) -> _Tuple | None:
        raise NotImplementedError

    def _frozen(self, items: list[Any]) -> _Tuple:
        """A frozenset: hashed once when built (its items were counted as put in), by identity."""
        frozen = _Tuple((), 1, 1 + max((x.depth for x in items if type(x) is _Tuple), default=0), "frozensets")
        keys = [self._key(x) for x in items]
        if any(k is None for k in keys):
            frozen.ident = None
            return frozen
        unique = dict((i, h) for h, i in keys)  # type: ignore[misc]
        frozen.h = hash(frozenset(_H(h) for h in unique.values()))
        frozen.ident = self._intern(self.ids, "f" + ",".join(map(str, sorted(unique))))
        return frozen

    def _key(self, value: Any) -> tuple[int, int] | None:
        """``(hash, identity)`` of a hashable value; None for one the shadow cannot hash. The
        identity is a small int, equal for equal values, found from keys whose hashes are seeded."""
        t = type(value)
        if t is str or t is bytes:
            return hash(value), self._intern(self.strs if t is str else self.blobs, value)
        if t is int or t is bool:
            raw = b"i" + int(value).to_bytes(value.bit_length() // 8 + 1, "little", signed=True)
        elif t is float:
            raw = b"f" + struct.pack("<d", value)
        elif t is complex:
            raw = b"c" + struct.pack("<dd", value.real, value.imag)
        elif value is None:
            raw = b"n"
        elif t is _Record:
            value = self._record_key(value)
            return None if value is None else self._key(value)
        elif t is _Tuple:
            self._resolve(value)
            return None if value.ident is None else (value.h, value.ident)
        else:
            return None
        return hash(value), self._intern(self.nums, raw)

    def _resolve(self, top: _Tuple) -> None:
        """Find the hash and identity of ``top`` and of the tuples in it not found yet, innermost
        first, without recursion; each tuple once."""
        todo = [top]
        while todo:
            cur = todo[-1]
            if cur.ident != -1:
                todo.pop()
                continue
            inner = [x for x in cur.items if type(x) is _Tuple and x.ident == -1]
            if inner:
                todo.extend(inner)
                continue
            todo.pop()
            keys = [self._key(x) for x in cur.items]
            if any(k is None for k in keys):
                cur.ident = None
                continue
            hashes = tuple(_H(k[0]) for k in keys)  # type: ignore[index]
            cur.h = _slice_hash(hashes) if cur.what == "slices" and _slice_hash else hash(hashes)
            # tuples, slices and MetadataIndex keys of equal items differ
            cur.ident = self._intern(self.ids, cur.what[0] + ",".join(str(k[1]) for k in keys))  # type: ignore[index]

    def _intern(self, table: dict[Any, int], key: Any) -> int:
        found = table.get(key)
        if found is None:
            found = table[key] = len(self.strs) + len(self.blobs) + len(self.nums) + len(self.ids)
        return found
