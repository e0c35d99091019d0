"""Sealed JSON documents (the manifest, and the per-rank indexes of format version 2): the
checksum that seals them, a parse bounded in time and memory, and the validators every field
goes through. A malformed input raises :class:`CorruptCheckpointError` naming the file."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, NoReturn

import xxhash

from stashpoint._core.naming import split_group
from stashpoint.errors import CheckpointError, CorruptCheckpointError, UnsupportedStateError

FORMAT_NAME = "stashpoint"
FORMAT_VERSION = 2  # 2: per-rank indexes and a catalog (docs/FORMAT.md); 1 still loads

CHECKSUM_ALGORITHM = "xxh3_64"
CHECKSUM_BLOCK_BYTES = 4 * 1024 * 1024
# What one manifest may hold, so that reading any manifest is bounded in time and memory.
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
MAX_MANIFEST_ENTRIES = 1_000_000  # chunks plus files
MAX_PARSE_MEMORY = 4 * 1024**3  # what parsing one manifest may allocate, by _parse_memory_bound
MAX_DIMS = 64
_DIM_CAP = 2**62  # a dimension or offset fits torch's int64 sizes


class ShortOfMemoryError(CheckpointError, MemoryError):
    """A checkpoint's metadata, within the bounds, needed more memory than the process could
    take: no sign of damage (a caller that tells damage from other failures must not take it
    for damage)."""


def short_of_memory(what: str, cause: MemoryError) -> ShortOfMemoryError:
    """The error for ``what`` (a load's planning, ...) having run out of memory, caused by ``cause``."""
    error = ShortOfMemoryError(f"{what} ran out of memory: run it in a process with more memory free")
    error.__cause__ = cause
    return error


def checksum(data: memoryview | bytes) -> str:
    """The checksum stashpoint records for a byte range (xxh3_64, hex)."""
    return xxhash.xxh3_64_hexdigest(data)


def running_checksum() -> xxhash.xxh3_64:
    """:func:`checksum` of bytes given in parts: ``update()`` with each in order, then ``hexdigest()``."""
    return xxhash.xxh3_64()


def block_checksums(data: memoryview) -> tuple[str, ...]:
    """Checksums of each CHECKSUM_BLOCK_BYTES block of ``data`` (one for empty data)."""
    n = len(data)
    if n == 0:
        return (checksum(data),)
    return tuple(checksum(data[b : b + CHECKSUM_BLOCK_BYTES]) for b in range(0, n, CHECKSUM_BLOCK_BYTES))


def _body(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")


def seal(doc: dict[str, Any], encoded: Mapping[str, bytes] | None = None) -> bytes:
    """The manifest's bytes: compact JSON whose last field, ``checksum``, is the xxh3-64 of the
    same JSON without it, so that damage anywhere in the manifest is detected. ``encoded``:
    fields given as their compact JSON already, after ``doc``'s (a plan's catalog, encoded
    once for every save of it)."""
    given = dict(encoded or {})
    body = _body({k: v for k, v in doc.items() if k != "checksum" and k not in given})
    for name, value in given.items():  # appended: a field's JSON is alike inside its document
        body = _appended(body, name, value)
    # the seal is appended too: the document is not encoded again with it
    raw = _appended(body, "checksum", json.dumps(checksum(body)).encode())
    # what a load would refuse is refused here: a checkpoint saved past the bounds never loads
    if len(raw) > MAX_MANIFEST_BYTES or _parse_memory_bound(raw) > MAX_PARSE_MEMORY:
        raise UnsupportedStateError(
            f"the checkpoint's {'manifest' if doc.get('format') == FORMAT_NAME else 'index'} would be "
            f"{len(raw) / 2**20:.0f} MiB of JSON with "
            f"{raw.count(b',') + 1} items, past what a load accepts ({MAX_MANIFEST_BYTES >> 20} MiB, "
            f"{MAX_PARSE_MEMORY >> 30} GiB to parse): its plain values (lists, strings, bytes) are too large. Keep "
            "large data in tensors (torch.tensor(a_list), torch.frombuffer(a_bytes, dtype=torch.uint8))"
        )
    return raw


def _appended(body: bytes, name: str, value: bytes) -> bytes:
    """The compact JSON object ``body`` with the field ``name``: ``value`` (its JSON) last."""
    return body[:-1] + (b"," if len(body) > 2 else b"") + json.dumps(name).encode() + b":" + value + b"}"


def _fail(where: str, what: str) -> NoReturn:
    raise CorruptCheckpointError(f"malformed manifest {where}: {what}")


def _want(cond: bool, where: str, what: str) -> None:
    if not cond:
        _fail(where, what)


def _int(v: object, where: str, what: str, lo: int = 0, *, key: str | None = None) -> int:
    """``v`` if it is an int >= ``lo``; ``what`` (``of key``, where given) names it otherwise.
    Per-entry callers pass ``key`` so that no message is formatted for a valid entry."""
    if type(v) is int and v >= lo:  # what json.loads gives; anything else is checked below
        return v
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= lo):
        _fail(where, f"{_named(what, key)} must be an int >= {lo}")
    assert isinstance(v, int)
    return v


def _ints(v: object, where: str, what: str, *, key: str | None = None) -> tuple[int, ...]:
    """Dimensions or offsets: each must fit torch's int64 sizes, even in a tensor of no elements."""
    if type(v) is list and len(v) <= MAX_DIMS:
        for x in v:  # a loop, not all(): a tenth of a manifest's parse is this line
            if type(x) is not int or not 0 <= x < _DIM_CAP:
                break
        else:
            return tuple(v)
    if not (isinstance(v, list) and len(v) <= MAX_DIMS):
        _fail(where, f"{_named(what, key)} must be a list of at most {MAX_DIMS} ints")
    out = tuple(_int(x, where, what, key=key) for x in v)
    if not all(x < _DIM_CAP for x in out):
        _fail(where, f"{_named(what, key)} holds a dimension over 2**62")
    return out


def _sized(shape: tuple[int, ...], item: int, where: str, key: str) -> None:
    """A tensor's bytes must fit torch's int64 sizes, counted over its non-zero dimensions as
    torch counts them (a shape of no elements with two 2**61 dimensions overflows there)."""
    if _overflows(shape, item):
        _fail(where, f"the shape of {key!r} holds more bytes than a tensor can ({list(shape)[:8]})")


def _overflows(shape: tuple[int, ...], item: int) -> bool:
    n = item
    for d in shape:
        n *= d or 1
        if n >= _DIM_CAP:
            return True
    return False


def shape_problem(shape: tuple[int, ...], item: int) -> str | None:
    """What a load would refuse in a tensor of ``shape`` and ``item`` bytes an element (None:
    nothing): for a save to refuse it first, not write a checkpoint its load calls damaged."""
    if len(shape) > MAX_DIMS:
        return f"has {len(shape)} dimensions, more than the format's {MAX_DIMS}"
    if any(d >= _DIM_CAP for d in shape) or _overflows(shape, item):  # the rules of _ints and _sized
        return f"of shape {list(shape)[:8]} holds more bytes than the format's 2**62"
    return None


def _named(what: str, key: str | None) -> str:
    return what if key is None else f"{what} of {key!r}"


def safe_file_name(name: object, where: str) -> str:
    """A shard file name must be a plain name inside the checkpoint directory, or inside one of
    its group directories (``g00012/name``), and nowhere else."""
    ok = isinstance(name, str) and 0 < len(name) <= 255 and "\x00" not in name
    ok = ok and split_group(name) is not None  # type: ignore[arg-type]
    allowed = "only plain names, or g<digits>/name, are allowed"
    _want(ok, where, f"file name {name!r} points outside the checkpoint ({allowed})")
    assert isinstance(name, str)
    return name


def _parse_memory_bound(raw: bytes) -> int:
    """An upper bound of what parsing ``raw`` allocates on CPython, from counts of the bytes that
    start objects: a dict, a list, a string (two quotes) or any further item (a comma), each
    with its pointer and growth slack; plus the text itself twice (read, and re-encoded for its
    checksum). Checked before ``json.loads``, which would allocate up to 26 bytes per byte."""
    counts = (raw.count(b"{"), raw.count(b"["), raw.count(b'"'), raw.count(b","))
    return 2 * len(raw) + sum(n * w for n, w in zip(counts, (240, 96, 64, 40)))


def _finite(text: str, odd: list[str]) -> float:
    value = float(text)  # also "NaN", "Infinity" and "-Infinity", which json.loads accepts
    if not math.isfinite(value):
        odd.append(text)
    return value


def _sealed_as_read(raw: bytes, claimed: str) -> bool:
    """Whether ``raw`` ends in the seal ``claimed`` and the bytes before it hash to it: then the
    seal is checked on the bytes as read instead of on the document encoded once more. A file
    :func:`seal` did not write (spaces, escapes, a key twice) passes only if its writer sealed
    those very bytes, and every rule of the parser still applies to what it holds; numbers that
    are not finite, which JSON has no form for, always go the slow way and fail there."""
    tail = b',"checksum":' + json.dumps(claimed).encode() + b"}"
    if not raw.endswith(tail):
        return False
    h = xxhash.xxh3_64(memoryview(raw)[: len(raw) - len(tail)])
    h.update(b"}")
    return h.hexdigest() == claimed


def open_sealed(raw: bytes, where: str, name: str = FORMAT_NAME) -> tuple[dict[str, Any], int]:
    """The document in ``raw`` (its format field must be ``name``), its seal checked and the
    seal removed, and its format version. Bounded: size and parse memory are checked first."""
    kind = "manifest" if name == FORMAT_NAME else "index"
    _want(len(raw) <= MAX_MANIFEST_BYTES, where, "larger than the size cap")
    _want(
        _parse_memory_bound(raw) <= MAX_PARSE_MEMORY,
        where,
        f"its structure could take more than {MAX_PARSE_MEMORY >> 30} GiB to parse (too many objects)",
    )
    odd: list[str] = []  # non-finite numbers: refused by the seal's check, so never the fast one
    try:
        doc = json.loads(raw, parse_constant=lambda c: _finite(c, odd), parse_float=lambda f: _finite(f, odd))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptCheckpointError(f"malformed manifest {where}: not valid JSON ({e})") from None
    except MemoryError as e:  # within the bound above, but more than this process may allocate
        raise short_of_memory(f"parsing the {kind} {where} ({len(raw) / 2**20:.0f} MiB of JSON)", e) from e
    _want(isinstance(doc, dict), where, "top level is not an object")
    _want(doc.get("format") == name, where, f"not a stashpoint {kind}")
    claimed = doc.pop("checksum", None)
    if odd or not (isinstance(claimed, str) and _sealed_as_read(raw, claimed)):
        try:
            actual = checksum(_body(doc))
        except (ValueError, RecursionError):
            actual = None
        # no seal at all, or a body with no JSON form (NaN): never equal, whatever was claimed
        sealed = isinstance(claimed, str) and actual is not None and claimed == actual
        _want(sealed, where, f"its checksum does not match its contents (the {kind} is damaged)")
    version = _int(doc.get("format_version"), where, "format_version", 1)
    if version > FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{kind} {where} has format version {version}, newer than this stashpoint reads "
            f"({FORMAT_VERSION}); upgrade stashpoint (pip install -U stashpoint)."
        )
    _want(doc.get("checksum_algorithm") == CHECKSUM_ALGORITHM, where, "unknown checksum_algorithm")
    block = doc.get("checksum_block_bytes")
    _want(type(block) is int and block == CHECKSUM_BLOCK_BYTES, where, "unsupported checksum_block_bytes")
    return doc, version


def common_fields(doc: dict[str, Any], where: str) -> dict[str, Any]:
    """The fields every manifest version has, validated."""
    for k in ("save_id", "created", "library_version", "torch_version"):
        _want(isinstance(doc.get(k), str), where, f"{k} must be a string")
    meta = doc.get("metadata", {})
    _want(
        isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values()), where, "metadata must map to strings"
    )
    return {k: doc[k] for k in ("save_id", "created", "library_version", "torch_version")} | {"metadata": meta}
