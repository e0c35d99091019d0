"""A scan of a pickle's opcodes, before anything unpickles it, for what makes unpickling take hours.

Dict keys and set items crafted to share one hash make building a table of N of them take N**2
steps: ints past 2**61 - 1, floats, complex numbers, tuples of them (tuple hashing is invertible).
The scan keeps a light shadow of the unpickler's stack and memo (constants, tuples, lists, calls
of the builtins that fill tables), counts the distinct values of each hash put into any table,
and estimates the unpickler's hashing and copying work: one big key or list reached through the
memo again and again costs the unpickler its size at each use. It reads each opcode once and
never recurses; whatever it does not follow is opaque, and a pickle it cannot follow (malformed,
or beyond its shadow) is left to the unpickler, which fails on it or does no worse.
"""

from __future__ import annotations

import functools
import io
import pickletools
import struct
from collections.abc import Callable
from typing import IO, Any

#: Distinct keys of one hash allowed: chance gives a handful, a flood needs thousands.
MAX_SAME_HASH = 1_000
#: The unpickler's estimated hashing and copying steps allowed per opcode read, and in all more.
WORK_PER_OP = 16
WORK_SLACK = 1 << 22
#: Hashing a key nests as deep as the key: a tuple a million deep overflows the C stack.
MAX_KEY_DEPTH = 1_000
_CACHED = 4096  # pickles of at most this many bytes have their verdicts kept
_SMALL = (1 << 61) - 1  # an int of smaller size hashes to itself: distinct ones never collide
_FILLS = {"builtins set", "builtins frozenset", "builtins dict", "collections OrderedDict", "collections Counter"}
_PAIRS = {"builtins dict", "collections OrderedDict"}  # filled from (key, value) pairs
_NAMES = {float: "floats", complex: "complex numbers"}


class Flood(Exception):
    """The pickle asks for unbounded work; the message says what, to follow "holds"."""


class _Stop(Exception):
    """The shadow cannot follow the pickle further."""


class _Global(str):
    """A global the pickle names, as ``"module name"``."""

    __slots__ = ()


class _List:
    __slots__ = ("items",)

    def __init__(self, items: list[Any]) -> None:
        self.items = items


class _Table:
    """A dict or set: its keys are counted as they are put in; ``n`` for copies of it."""

    __slots__ = ("n",)

    def __init__(self, n: int = 0) -> None:
        self.n = n


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


def scan(source: bytes | IO[bytes]) -> None:
    """Raise :class:`Flood` if the pickle ``source`` (at a stream's position) asks for unbounded
    work; read up to its STOP, or to where the shadow stops following it."""
    if isinstance(source, bytes) and len(source) <= _CACHED:
        flood = _scan_small(source)
        if flood is not None:
            raise Flood(flood)
        return
    _scan(source)


@functools.lru_cache(maxsize=1024)
def _scan_small(raw: bytes) -> str | None:
    """A small pickle's verdict, kept: a DCP checkpoint holds a pickle per tensor, most alike."""
    try:
        _scan(raw)
    except Flood as e:
        return str(e)
    return None


def _scan(source: bytes | IO[bytes]) -> None:
    shadow = _Shadow()
    try:
        for shadow.ops, (op, arg, _) in enumerate(
            pickletools.genops(io.BytesIO(source) if isinstance(source, bytes) else source), 1
        ):
            _OPS[op.name](shadow, op.name, arg)  # an opcode newer than the table: KeyError, stop
    except Flood:
        raise
    except Exception:  # malformed, or past the shadow (RecursionError included): the unpickler's
        return


class _Shadow:
    def __init__(self) -> None:
        self.stack: list[Any] = []
        self.marks: list[list[Any]] = []
        self.memo: dict[Any, Any] = {}
        # identities, one table per kind, keyed by str or bytes only (their hashes are seeded)
        self.strs: dict[str, int] = {}
        self.blobs: dict[bytes, int] = {}  # bytes values
        self.nums: dict[bytes, int] = {}  # numbers and None, by their bytes
        self.ids: dict[str, int] = {}  # tuples and frozensets, by their items' identities
        self.seen: set[int] = set()
        self.per_hash: dict[int, int] = {}
        self.work = self.ops = 0
        self.empty = _Tuple((), 1, 1)  # one (), as CPython has

    # what the unpickler does with each opcode (the table _OPS below): (self, opcode name, argument)
    def _memo(self, name: str, index: Any) -> None:
        if type(index) is not int:
            raise _Stop
        if not -_SMALL < index < _SMALL:
            self._put(index)  # a memo index is a dict key of the unpickler (protocol 0 takes any int)
        if name.endswith("PUT"):
            self.memo[index] = self.stack[-1]
        else:
            self.stack.append(self.memo[index])

    def _mark(self, name: str, arg: None) -> None:
        self.marks.append(self.stack)
        self.stack = []

    def _tuple_n(self, name: str, arg: None) -> None:
        n, stack = int(name[-1]), self.stack
        if len(stack) < n:
            raise _Stop
        items = stack[len(stack) - n :]
        del stack[len(stack) - n :]
        stack.append(self._tuple(items))

    def _setitems(self, name: str, arg: None) -> None:
        items = [self.stack.pop(), self.stack.pop()][::-1] if name == "SETITEM" else self._pop_mark()
        for k in items[::2]:
            self._put(k)
        if name == "DICT":
            self._push(_Table(len(items) // 2))
        elif type(self.stack[-1]) is _Table:
            self.stack[-1].n += len(items) // 2

    def _additems(self, name: str, arg: None) -> None:
        items = self._pop_mark()
        for k in items:
            self._put(k)
        if name == "FROZENSET":
            self._push(self._frozen(items))
        elif type(self.stack[-1]) is _Table:
            self.stack[-1].n += len(items)

    def _append(self, name: str, arg: None) -> None:
        items = [self.stack.pop()] if name == "APPEND" else self._pop_mark()
        if type(self.stack[-1]) is _List:
            self.stack[-1].items.extend(items)

    def _stack_global(self, name: str, arg: None) -> None:
        attr, module = self.stack.pop(), self.stack.pop()
        ok = type(attr) is str and type(module) is str
        self._push(_Global(f"{module} {attr}") if ok else _OPAQUE)

    def _reduce(self, name: str, arg: None) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._call(self.stack[-1], args)

    def _newobj(self, name: str, arg: None) -> None:
        if name == "NEWOBJ_EX":
            self.stack.pop()  # keyword arguments: none of the calls followed takes them
        args = self.stack.pop()
        self._push(self._call(self.stack.pop(), args))

    def _obj(self, name: str, arg: str | None) -> None:
        items = self._pop_mark()
        if name == "INST":
            self._push(self._call(_global(arg or ""), self._tuple(items)))
        else:
            self._push(self._call(items[0], self._tuple(items[1:])))

    def _build(self, name: str, arg: None) -> None:
        state = self.stack.pop()
        if type(state) is _Table:  # an object's attributes set from a dict: copied once more
            self._charge(state.n)
        if not self.stack:
            raise _Stop  # BUILD needs an object below its state

    def _pop(self, name: str, arg: None) -> None:
        if name == "POP" and self.stack:
            self.stack.pop()
        else:
            self._pop_mark()

    def _push(self, value: Any) -> None:
        self.stack.append(value)

    def _pop_mark(self) -> list[Any]:
        items = self.stack
        self.stack = self.marks.pop()
        return items

    def _tuple(self, items: list[Any]) -> _Tuple:
        cost, depth = 1 + len(items), 1  # a step per item, more for tuples and long ints in it
        for x in items:
            t = type(x)
            if t is _Tuple:
                cost += x.cost - 1
                depth = max(depth, x.depth + 1)
            elif t is int and not -_SMALL < x < _SMALL:
                cost += x.bit_length() >> 6  # hashing an int reads all its digits
        return _Tuple(tuple(items), min(cost, 1 << 62), depth)

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

    def _call(self, func: Any, args: Any) -> Any:
        """What calling the global ``func`` on ``args`` gives: a table of the keys put in it, a
        complex number, a frozenset; anything else opaque."""
        if type(func) is not _Global or type(args) is not _Tuple:
            return _OPAQUE
        items, copied = args.items, 1
        for x in items:
            if type(x) is _List or type(x) is _Tuple:
                copied += len(x.items)
        self._charge(copied)  # the copies a call may make of lists and tuples it is given
        if func == "builtins complex" and len(items) <= 2:
            if all(type(x) in (int, float, bool, complex) or (type(x) is str and len(x) < 100) for x in items):
                try:
                    return complex(*items)
                except (TypeError, ValueError, OverflowError):
                    return _OPAQUE
        elif func == "torch Size" and len(items) == 1 and type(items[0]) in (_List, _Tuple):
            return self._tuple(list(items[0].items))
        elif func in _FILLS:
            src = items[0] if items else _List([])
            if type(src) is _Table:
                self._charge(src.n)
                return _Table(src.n)
            elements = src.items if type(src) in (_List, _Tuple) else []
            if func in _PAIRS:
                keys = [p.items[0] for p in elements if type(p) in (_List, _Tuple) and len(p.items) == 2]
            else:
                keys = list(elements)
            for k in keys:
                self._put(k)
            return self._frozen(keys) if func == "builtins frozenset" else _Table(len(keys))
        return _OPAQUE

    def _put(self, value: Any) -> None:
        """``value`` put into a dict or set: count it among the distinct values of its hash."""
        t = type(value)
        if t is int:
            if -_SMALL < value < _SMALL:
                return  # its own hash: distinct small ints never collide
            what = "integers"
        elif t is _Tuple:
            if value.depth > MAX_KEY_DEPTH:
                raise Flood(f"a dict key or set item nested more than {MAX_KEY_DEPTH} deep")
            what = value.what
        elif t in (float, complex):
            what = _NAMES[t]
        else:
            return  # str and bytes hash with a random seed; None, bool: one value; others opaque
        self._charge(value.cost if t is _Tuple else 1 + (value.bit_length() // 64 if t is int else 0))
        key = self._key(value)
        if key is None:
            return
        h, ident = key
        n = self.per_hash.get(h, 0)
        if ident not in self.seen:
            self.seen.add(ident)
            n = self.per_hash[h] = n + 1
            if n > MAX_SAME_HASH:
                raise Flood(
                    f"more than {MAX_SAME_HASH} {what} of one hash (dict keys or set items: a table of N of them "
                    "takes N**2 steps to build)"
                )
        self._charge(n)  # each put compares with the values of its hash already there

    def _charge(self, steps: int) -> None:
        self.work += steps
        if self.work > WORK_PER_OP * self.ops + WORK_SLACK:
            raise Flood(
                f"dict keys or set items that take more than {self.work} steps to unpickle from {self.ops} opcodes "
                "(keys long to hash, of one hash, or copied again and again through the memo)"
            )

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
            cur.h = hash(tuple(_H(k[0]) for k in keys))  # type: ignore[index]
            cur.ident = self._intern(self.ids, "t" + ",".join(str(k[1]) for k in keys))  # type: ignore[index]

    def _intern(self, table: dict[Any, int], key: Any) -> int:
        found = table.get(key)
        if found is None:
            found = table[key] = len(self.strs) + len(self.blobs) + len(self.nums) + len(self.ids)
        return found


_CONSTANTS = (
    *("INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT", "STRING", "BINSTRING"),
    *("SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES"),
    "BINBYTES8",
)
_Op = Callable[[_Shadow, str, Any], None]
_OPS: dict[str, _Op] = {
    **dict.fromkeys(_CONSTANTS, lambda s, n, arg: s.stack.append(arg)),
    **dict.fromkeys(("BINPUT", "LONG_BINPUT", "PUT", "BINGET", "LONG_BINGET", "GET"), _Shadow._memo),
    "MEMOIZE": lambda s, n, a: s.memo.__setitem__(len(s.memo), s.stack[-1]),
    "MARK": _Shadow._mark,
    "TUPLE": lambda s, n, a: s._push(s._tuple(s._pop_mark())),
    **dict.fromkeys(("TUPLE1", "TUPLE2", "TUPLE3"), _Shadow._tuple_n),
    "EMPTY_TUPLE": lambda s, n, a: s.stack.append(s.empty),
    "REDUCE": _Shadow._reduce,
    "BINPERSID": lambda s, n, a: s.stack.__setitem__(-1, _OPAQUE),
    **dict.fromkeys(("PERSID", "EXT1", "EXT2", "EXT4", "BYTEARRAY8", "NEXT_BUFFER"), lambda s, n, a: s._push(_OPAQUE)),
    "NONE": lambda s, n, a: s.stack.append(None),
    "NEWTRUE": lambda s, n, a: s.stack.append(True),
    "NEWFALSE": lambda s, n, a: s.stack.append(False),
    **dict.fromkeys(("SETITEM", "SETITEMS", "DICT"), _Shadow._setitems),
    **dict.fromkeys(("ADDITEMS", "FROZENSET"), _Shadow._additems),
    **dict.fromkeys(("EMPTY_DICT", "EMPTY_SET"), lambda s, n, a: s.stack.append(_Table())),
    "EMPTY_LIST": lambda s, n, a: s.stack.append(_List([])),
    "LIST": lambda s, n, a: s._push(_List(s._pop_mark())),
    **dict.fromkeys(("APPEND", "APPENDS"), _Shadow._append),
    "GLOBAL": lambda s, n, arg: s.stack.append(_global(arg)),
    "STACK_GLOBAL": _Shadow._stack_global,
    **dict.fromkeys(("NEWOBJ", "NEWOBJ_EX"), _Shadow._newobj),
    **dict.fromkeys(("INST", "OBJ"), _Shadow._obj),
    "BUILD": _Shadow._build,
    **dict.fromkeys(("POP", "POP_MARK"), _Shadow._pop),
    "DUP": lambda s, n, a: s.stack.append(s.stack[-1]),
    **dict.fromkeys(("PROTO", "FRAME", "STOP", "READONLY_BUFFER"), lambda s, n, a: None),
}
