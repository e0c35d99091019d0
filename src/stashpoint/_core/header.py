"""The header of a shard file: safetensors' layout (8-byte length, JSON, padding), so that any
safetensors reader opens a shard; stashpoint adds its save id in ``__metadata__``."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from json.encoder import encode_basestring_ascii as _str
from typing import Any

from stashpoint._core.sealed import short_of_memory
from stashpoint.errors import CorruptCheckpointError

HEADER_ALIGN = 4096
MAX_HEADER_BYTES = 100 * 1024 * 1024


def encode_header(
    entries: bytes,
    metadata: Mapping[str, str],
    *,
    align: int = HEADER_ALIGN,
) -> bytes:
    """Encode a safetensors header: 8-byte little-endian length, JSON, padded with spaces.

    ``entries`` are the tensors' fields, as :func:`encode_entries` gives them (a layout's, made
    once for every save of it). The result's length is a multiple of ``align``, so the data
    section starts aligned.
    """
    meta = json.dumps({"__metadata__": dict(metadata)}, separators=(",", ":")).encode("utf-8")
    body = meta[:-1] + (b"," + entries if entries else b"") + b"}"
    total = -(-(8 + len(body)) // align) * align
    body += b" " * (total - 8 - len(body))
    return struct.pack("<Q", len(body)) + body


def encode_entries(entries: Sequence[tuple[str, str, Sequence[int], int, int]]) -> bytes:
    """The tensors' fields of a header's JSON, compact and without the braces around them (as
    ``json.dumps`` writes them; as text, not a dict and lists per tensor, which set off
    collections of the heap by the ten thousand)."""
    return ",".join(
        f'{_str(name)}:{{"dtype":{_str(st)},"shape":[{",".join(map(str, shape))}],"data_offsets":[{b},{e}]}}'
        for name, st, shape, b, e in entries
    ).encode("ascii")


def header_length(prefix: bytes, file_size: int, where: str) -> int:
    """Validate the 8-byte length prefix of a shard; return the header's JSON length."""
    if len(prefix) < 8:
        raise CorruptCheckpointError(f"shard {where} is truncated: shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise CorruptCheckpointError(f"shard {where} has an invalid header length {n} (file is {file_size} bytes)")
    return int(n)


def parse_header(raw: bytes, file_size: int, where: str) -> dict[str, Any]:
    """Parse a shard's header (``raw`` holds at least the prefix and JSON) and check its offsets."""
    n = header_length(raw, file_size, where)
    try:
        doc = json.loads(raw[8 : 8 + n])
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptCheckpointError(f"shard {where} has a malformed header: {e}") from None
    except MemoryError as e:
        raise short_of_memory(f"parsing the header of shard {where} ({n / 2**20:.0f} MiB of JSON)", e) from e
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"shard {where} has a malformed header: not an object")
    data_len = file_size - 8 - n
    for name, entry in doc.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2):
            raise CorruptCheckpointError(f"shard {where}: header entry {name!r} is malformed")
        b, end = offsets
        if not (isinstance(b, int) and isinstance(end, int) and 0 <= b <= end <= data_len):
            raise CorruptCheckpointError(f"shard {where}: header entry {name!r} points outside the file")
    return doc
