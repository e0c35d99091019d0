"""The values of :mod:`.picklescan`'s shadow of the unpickler's stack and memo: what the scan
knows of a global, a list, a dict or set, a ``MetadataIndex``, a tuple, a hash."""

from __future__ import annotations

from typing import Any


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
