"""A scan of a pickle's opcodes, before anything unpickles it, for what makes unpickling take hours.

Dict keys and set items crafted to share one hash make building a table of N of them take N**2
steps: ints past 2**61 - 1, floats, complex numbers, tuples of them (tuple hashing is invertible).
The scan keeps a light shadow of the unpickler's stack and memo (constants, tuples, lists, calls
of the builtins that fill tables), counts the distinct values of each hash put into any table,
and estimates the unpickler's hashing and copying work: one big key or list reached through the
memo again and again costs the unpickler its size at each use, and a table reached again (an
object's state, a copy) costs the comparisons its keys took once more. DCP's ``MetadataIndex``
keys (and slices, hashable from Python 3.12) are counted with the hash Python gives them. It
reads each opcode once and never recurses; whatever it does not follow is opaque. A pickle cut
short is left to the unpickler, which fails where the scan stopped; but one the shadow stops
following before its STOP is refused: the unpickler would go on reading what nobody scanned.
"""

from __future__ import annotations

import functools
import io
import pickletools
from collections.abc import Callable
from typing import IO, Any

from stashpoint._tools import picklevalues
from stashpoint._tools.picklevalues import _OPAQUE, _Global, _global, _Identities, _List, _Record, _Table, _Tuple

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
_MDINDEX = "torch.distributed.checkpoint.metadata MetadataIndex"  # a frozen dataclass: hash((fqn, offset))
_FIELDS = frozenset(("fqn", "offset"))  # the attributes of a MetadataIndex its hash reads


class Flood(Exception):
    """The pickle asks for unbounded work; the message says what, to follow "holds"."""


class _Stop(Exception):
    """The pickle is malformed where the unpickler fails too (a stack underflow)."""


class _Beyond(Exception):
    """The pickle goes on where the shadow cannot follow it."""


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
    shadow, stream = _Shadow(), io.BytesIO(source) if isinstance(source, bytes) else source
    try:
        while True:
            code = stream.read(1)
            op = _CODES.get(code)
            if op is None:
                return  # cut short, or an opcode unknown to this Python: the unpickler fails here too
            arg = None if op.arg is None else _READERS.get(op.name, op.arg.reader)(stream)
            shadow.ops += 1
            handler = _OPS.get(op.name)
            if handler is None:
                raise _Beyond(op.name)  # an opcode newer than the shadow
            try:
                handler(shadow, op.name, arg)
            except (IndexError, KeyError, _Stop):
                return  # the stack or a mark runs out, or a memo index is unset: the unpickler fails here too
            if op.name == "STOP":
                return
    except Flood:
        raise
    except Exception as e:  # past the shadow (RecursionError included), or an argument cut short
        if not isinstance(e, ValueError) or stream.read(1):
            raise Flood(
                f"an opcode sequence stashpoint's check cannot follow ({type(e).__name__} after {shadow.ops} "
                "opcodes), which the unpickler would go on reading unchecked"
            ) from None


def _readline(stream: IO[bytes]) -> bytes:
    line = stream.readline()
    if not line.endswith(b"\n"):
        raise ValueError("no newline")  # cut short
    return line[:-1]


def _read_int(stream: IO[bytes]) -> int:
    """INT's argument as the unpickler reads it: ``00`` and ``01`` False and True, else any base."""
    line = _readline(stream)
    return line == b"01" if line in (b"00", b"01") else int(line, 0)


def _read_long(stream: IO[bytes]) -> int:
    line = _readline(stream)
    return int(line[:-1] if line.endswith(b"L") else line, 0)


#: The opcodes by code, and readers of the arguments pickletools reads unlike the unpickler
#: (genops makes PUT and GET's ``01`` True and refuses INT and LONG's ``0x10``).
_CODES = {op.code.encode("latin-1"): op for op in pickletools.opcodes}
_READERS: dict[str, Callable[[IO[bytes]], Any]] = {
    "INT": _read_int,
    "LONG": _read_long,
    **dict.fromkeys(("PUT", "GET"), lambda stream: int(_readline(stream))),
}


class _Shadow(_Identities):
    def __init__(self) -> None:
        super().__init__()
        self.stack: list[Any] = []
        self.marks: list[list[Any]] = []
        self.memo: dict[Any, Any] = {}
        self.seen: set[int] = set()
        self.per_hash: dict[int, int] = {}
        self.work = self.ops = 0
        self.empty = _Tuple((), 1, 1)  # one (), as CPython has

    # what the unpickler does with each opcode (the table _OPS below): (self, opcode name, argument)
    def _memo(self, name: str, index: Any) -> None:
        index = int(index)  # BINPUT's and the like, or PUT's read as the unpickler does
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
        cost = sum(self._put(k) for k in items[::2])
        table = _Table() if name == "DICT" else self.stack[-1]
        if name == "DICT":
            self._push(table)
        if type(table) is _Table:
            table.n, table.cost = table.n + len(items) // 2, table.cost + cost
            table.attrs.update((k, v) for k, v in zip(items[::2], items[1::2]) if type(k) is str and k in _FIELDS)

    def _additems(self, name: str, arg: None) -> None:
        items = self._pop_mark()
        cost = sum(self._put(k) for k in items)
        if name == "FROZENSET":
            self._push(self._frozen(items))
        elif type(self.stack[-1]) is _Table:
            self.stack[-1].n += len(items)
            self.stack[-1].cost += cost

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
        args, cls = self.stack.pop(), self.stack.pop()
        self._push(_Record({}) if type(cls) is _Global and cls == _MDINDEX else self._call(cls, args))

    def _obj(self, name: str, arg: str | None) -> None:
        items = self._pop_mark()
        if name == "INST":
            self._push(self._call(_global(arg or ""), self._tuple(items)))
        else:
            self._push(self._call(items[0], self._tuple(items[1:])))

    def _build(self, name: str, arg: None) -> None:
        state = self.stack.pop()
        if not self.stack:
            raise _Stop  # BUILD needs an object below its state
        if type(state) is _Tuple and len(state.items) == 2:  # (attributes, slots)
            state = state.items[0]
        if type(state) is _Table:  # an object's attributes set from a dict: put in once more
            self._charge(state.n + state.cost)
            if type(self.stack[-1]) is _Record:
                self.stack[-1].attrs.update(state.attrs)

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

    def _tuple(self, items: list[Any], what: str = "tuples") -> _Tuple:
        cost, depth = 1 + len(items), 1  # a step per item, more for tuples and long ints in it
        for x in items:
            t = type(x)
            if t is _Tuple:
                cost += x.cost - 1
                depth = max(depth, x.depth + 1)
            elif t is int and not -_SMALL < x < _SMALL:
                cost += x.bit_length() >> 6  # hashing an int reads all its digits
        return _Tuple(tuple(items), min(cost, 1 << 62), depth, what)

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
        elif func == "torch Size" and len(items) == 1:
            return self._size(items[0])
        elif func == _MDINDEX and 1 <= len(items) <= 3:
            offset = items[1] if len(items) > 1 else None
            return _Record({"fqn": items[0], "offset": None if offset is None else self._size(offset)})
        elif func == "builtins slice" and 1 <= len(items) <= 3 and picklevalues._slice_hash is not None:
            return self._tuple([None, items[0], None] if len(items) == 1 else [*items, None][:3], "slices")
        elif func in _FILLS:
            src = items[0] if items else _List([])
            if type(src) is _Table:  # its keys put in again: as many steps as they took
                self._charge(src.n + src.cost)
                return _Table(src.n, src.cost)
            elements = src.items if type(src) in (_List, _Tuple) else []
            if func in _PAIRS:
                keys = [p.items[0] for p in elements if type(p) in (_List, _Tuple) and len(p.items) == 2]
            else:
                keys = list(elements)
            cost = sum(self._put(k) for k in keys)
            return self._frozen(keys) if func == "builtins frozenset" else _Table(len(keys), cost)
        return _OPAQUE

    def _size(self, items: Any) -> Any:
        """``torch.Size(items)``: a tuple."""
        return self._tuple(list(items.items)) if type(items) in (_List, _Tuple) else _OPAQUE

    def _record_key(self, record: _Record) -> _Tuple | None:
        """The tuple a ``MetadataIndex`` hashes as; None if it lacks its ``fqn``."""
        if "fqn" not in record.attrs:
            return None
        return self._tuple([record.attrs["fqn"], record.attrs.get("offset")], "MetadataIndex keys")

    def _put(self, value: Any) -> int:
        """``value`` put into a dict or set: count it among the distinct values of its hash; the
        steps that takes (charged)."""
        if type(value) is _Record:
            value = self._record_key(value)
        t = type(value)
        if t is int:
            if -_SMALL < value < _SMALL:
                return 0  # its own hash: distinct small ints never collide
            what = "integers"
        elif t is _Tuple:
            if value.depth > MAX_KEY_DEPTH:
                raise Flood(f"a dict key or set item nested more than {MAX_KEY_DEPTH} deep")
            what = value.what
        elif t in (float, complex):
            what = _NAMES[t]
        else:
            return 0  # str and bytes hash with a random seed; None, bool: one value; others opaque
        steps = value.cost if t is _Tuple else 1 + (value.bit_length() // 64 if t is int else 0)
        self._charge(steps)
        key = self._key(value)
        if key is None:
            return steps
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
        return steps + n

    def _charge(self, steps: int) -> None:
        self.work += steps
        if self.work > WORK_PER_OP * self.ops + WORK_SLACK:
            raise Flood(
                f"dict keys or set items that take more than {self.work} steps to unpickle from {self.ops} opcodes "
                "(keys long to hash, of one hash, or copied again and again through the memo)"
            )


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
