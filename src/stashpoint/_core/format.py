"""The on-disk format: shard headers (safetensors layout) and the manifest (versioned JSON).

Everything read from a file is validated here before use; a malformed input raises
:class:`CorruptCheckpointError` naming the file. See docs/FORMAT.md for the specification.
"""

from __future__ import annotations

import datetime as _dt
import functools
import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from stashpoint._core.dtypes import itemsize
from stashpoint._core.header import HEADER_ALIGN, MAX_HEADER_BYTES
from stashpoint._core.nodes import check_tree
from stashpoint._core.reshard import block_count
from stashpoint._core.sealed import (
    CHECKSUM_ALGORITHM,
    CHECKSUM_BLOCK_BYTES,
    FORMAT_NAME,
    MAX_MANIFEST_BYTES,
    MAX_MANIFEST_ENTRIES,
    _int,
    _ints,
    _sized,
    _want,
    block_checksums,
    checksum,
    common_fields,
    open_sealed,
    running_checksum,
    safe_file_name,
    seal,
)
from stashpoint.errors import CorruptCheckpointError

__all__ = [
    "CHECKSUM_BLOCK_BYTES",
    "MAX_MANIFEST_BYTES",
    "Chunk",
    "FileEntry",
    "Manifest",
    "TensorEntry",
    "block_checksums",
    "checksum",
    "parse_manifest",
    "running_checksum",
    "seal",
]

# ---------------------------------------------------------------------------------------------
# Records


def utc_stamp() -> str:
    """Now, as a manifest's ``created`` is written: UTC, ISO 8601, to the millisecond (a rewind
    mark is compared with it, so both are made here)."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a tensor: its place in the global tensor and its bytes in a file."""

    file: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    start: int
    end: int
    checksums: tuple[str, ...]  # one per CHECKSUM_BLOCK_BYTES block of [start, end)


@dataclass(frozen=True)
class TensorEntry:
    """A tensor of the state: global dtype and shape, its chunks, or the key it aliases."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...] = ()
    alias_of: str | None = None


@dataclass(frozen=True)
class FileEntry:
    """A shard file: total size, where its data starts, and the checksum of its header."""

    name: str
    size: int
    data_start: int
    header_checksum: str
    rank: int = 0


@dataclass(frozen=True)
class Manifest:
    """The commit record of a checkpoint. A checkpoint exists if and only if this exists."""

    save_id: str
    created: str
    library_version: str
    torch_version: str
    files: tuple[FileEntry, ...]
    tensors: Mapping[str, TensorEntry]
    trees: tuple[dict[str, Any], ...]  # distinct state trees (plain values differ per rank)
    metadata: Mapping[str, str] = field(default_factory=dict)
    world_size: int = 1
    tree_of_rank: tuple[int, ...] = (0,)  # rank -> index into trees
    format_version: int = 1  # as read; ``to_json`` writes version 1 (version 2: ``_core.index``)
    checksum_algorithm: str = CHECKSUM_ALGORITHM
    indexes: tuple[tuple[str, int], ...] = ()  # version 2: each rank's index (name, size)

    @functools.cached_property
    def keys_by_file(self) -> dict[str, set[str]]:
        """The keys each file holds chunks of (worked out once: errors name them file by file)."""
        found: dict[str, set[str]] = {}
        for k, e in self.tensors.items():
            for c in e.chunks:
                found.setdefault(c.file, set()).add(k)
        return found

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "format_version": 1,
            "save_id": self.save_id,
            "created": self.created,
            "library_version": self.library_version,
            "torch_version": self.torch_version,
            "world_size": self.world_size,
            "checksum_algorithm": self.checksum_algorithm,
            "checksum_block_bytes": CHECKSUM_BLOCK_BYTES,
            "metadata": dict(self.metadata),
            "files": [asdict(f) for f in self.files],
            "tensors": {k: _entry_doc(e) for k, e in self.tensors.items()},
            "trees": list(self.trees),
            "tree_of_rank": list(self.tree_of_rank),
        }
        return seal(doc)

    def tree_for(self, rank: int) -> dict[str, Any]:
        """The state tree saved by ``rank``; rank ``r`` of a larger world gets that of ``r mod N``."""
        return self.trees[self.tree_of_rank[rank % len(self.tree_of_rank)]]

    def resolve(self, key: str) -> TensorEntry:
        """The entry holding the bytes of ``key`` (following an alias)."""
        entry = self.tensors[key]
        return self.tensors[entry.alias_of] if entry.alias_of is not None else entry


def _entry_doc(e: TensorEntry) -> dict[str, Any]:
    if e.alias_of is not None:
        return {"dtype": e.dtype, "shape": list(e.shape), "alias_of": e.alias_of}
    return {
        "dtype": e.dtype,
        "shape": list(e.shape),
        "chunks": [
            {
                "file": c.file,
                "offsets": list(c.offsets),
                "shape": list(c.shape),
                "start": c.start,
                "end": c.end,
                "checksums": list(c.checksums),
            }
            for c in e.chunks
        ],
    }


# ---------------------------------------------------------------------------------------------
# Manifest parsing (every field validated)


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """Parse and validate version-1 manifest bytes; raise :class:`CorruptCheckpointError` if
    malformed (a version-2 manifest needs its indexes: ``_core.index.parse_head``)."""
    doc, version = open_sealed(raw, where)
    _want(version == 1, where, f"format version {version} is not read by parse_manifest")
    return parse_v1(doc, where)


def parse_v1(doc: dict[str, Any], where: str) -> Manifest:
    """A version-1 manifest from its opened document (see :func:`open_sealed`)."""
    version = 1
    head = common_fields(doc, where)
    meta = head["metadata"]
    files_doc = doc.get("files")
    _want(isinstance(files_doc, list), where, "files must be a list")
    tensors_doc = doc.get("tensors")
    _want(isinstance(tensors_doc, dict), where, "tensors must be an object")
    assert isinstance(files_doc, list) and isinstance(tensors_doc, dict)
    chunk_lists = (e.get("chunks") for e in tensors_doc.values() if isinstance(e, dict))
    of_rank = doc.get("tree_of_rank")  # an entry per rank: a world of 80 million fit in 152 MB
    ranks = len(of_rank) if isinstance(of_rank, list) else 0
    entries = len(files_doc) + sum(len(c) for c in chunk_lists if isinstance(c, list)) + ranks
    cap = MAX_MANIFEST_ENTRIES
    _want(entries <= cap, where, f"it lists {entries} chunks, files and ranks (the cap is {cap})")
    files: dict[str, FileEntry] = {}
    for f in files_doc:
        _want(isinstance(f, dict), where, "file entry must be an object")
        name = safe_file_name(f.get("name"), where)
        _want(name not in files, where, f"file {name!r} listed twice")
        hc = f.get("header_checksum")
        _want(isinstance(hc, str), where, f"header_checksum of {name!r} must be a string")
        size = _int(f.get("size"), where, f"size of {name!r}")
        start = _int(f.get("data_start"), where, f"data_start of {name!r}", 8)
        _want(start <= size, where, f"data_start of {name!r} is past its end")
        _want(start <= 8 + MAX_HEADER_BYTES + HEADER_ALIGN, where, f"the header of {name!r} is over the size cap")
        files[name] = FileEntry(name, size, start, str(hc), _int(f.get("rank", 0), where, "rank"))
    tensors: dict[str, TensorEntry] = {}
    for key in tensors_doc:
        tensors[key] = _parse_entry(key, tensors_doc[key], files, where)
        tensors_doc[key] = None  # the JSON of an entry is freed once parsed: peak memory is not both
    for key, entry in tensors.items():
        if entry.alias_of is not None:
            target = tensors.get(entry.alias_of)
            _want(target is not None and target.alias_of is None, where, f"{key!r} aliases a missing entry")
            assert target is not None
            _want(
                (target.dtype, target.shape) == (entry.dtype, entry.shape),
                where,
                f"{key!r} aliases {entry.alias_of!r} of another dtype or shape",
            )
        else:
            _check_tiling(entry, where)
    _check_byte_ranges(((e.key, c) for e in tensors.values() for c in e.chunks), where)
    trees = doc.get("trees")
    _want(isinstance(trees, list) and len(trees) > 0, where, "trees must be a non-empty list")
    assert isinstance(trees, list)
    try:
        for tree in trees:
            check_tree(tree, tensors, where, 0)
    except RecursionError:
        raise CorruptCheckpointError(f"malformed manifest {where}: tree nested too deeply") from None
    world = _int(doc.get("world_size", 1), where, "world_size", 1)
    _want(
        isinstance(of_rank, list)
        and len(of_rank) == world
        and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(trees) for i in of_rank),
        where,
        "tree_of_rank must give a valid tree index for every rank",
    )
    assert isinstance(of_rank, list)
    return Manifest(
        save_id=doc["save_id"],
        created=doc["created"],
        library_version=doc["library_version"],
        torch_version=doc["torch_version"],
        files=tuple(files.values()),
        tensors=tensors,
        trees=tuple(trees),
        metadata=meta,
        world_size=world,
        tree_of_rank=tuple(of_rank),
        format_version=version,
    )


def _check_tiling(entry: TensorEntry, where: str) -> None:
    """A tensor's chunks cover it exactly once: no holes (reads would leave memory unset), no
    overlaps. Linear in the chunks: the chunks' edges cut each dimension into intervals, a
    valid layout is a grid of those (one cell per chunk), and marking each chunk's cells finds
    any overlap; a layout with far more cells than chunks is no grid and is refused."""
    total = math.prod(entry.shape)
    got = sum(math.prod(c.shape) for c in entry.chunks)
    _want(got == total, where, f"the chunks of {entry.key!r} hold {got} elements, its shape {total}")
    chunks = [c for c in entry.chunks if math.prod(c.shape) > 0]
    if len(chunks) < 2:  # one chunk of the whole volume, inside the bounds: the tensor itself
        return
    index = []
    for d, n in enumerate(entry.shape):
        edges = sorted({0, n, *(c.offsets[d] for c in chunks), *(c.offsets[d] + c.shape[d] for c in chunks)})
        index.append({e: i for i, e in enumerate(edges)})
    counts = [len(ix) - 1 for ix in index]
    cells = math.prod(counts)
    _want(cells <= 4 * len(chunks) + 64, where, f"the chunks of {entry.key!r} do not form a grid")
    strides = [math.prod(counts[d + 1 :]) for d in range(len(counts))]
    seen = bytearray(cells)
    for c in chunks:
        spans = [range(ix[o], ix[o + k]) for ix, o, k in zip(index, c.offsets, c.shape)]
        for cell in itertools.product(*spans):  # at most ``cells`` marks before an overlap is found
            i = sum(a * b for a, b in zip(cell, strides))
            _want(not seen[i], where, f"two chunks of {entry.key!r} overlap")
            seen[i] = 1


def _check_byte_ranges(chunks: Iterable[tuple[str, Chunk]], where: str) -> None:
    """No two chunks (key, chunk) share bytes of a file, so what a load allocates is bounded by
    the bytes the files hold (tied tensors are stored once, as aliases)."""
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    for key, c in chunks:
        if c.end > c.start:
            ranges.setdefault(c.file, []).append((c.start, c.end, key))
    for name, spans in ranges.items():
        spans.sort()
        for (_, end, a), (start, _, b) in itertools.pairwise(spans):
            _want(start >= end, where, f"{a!r} and {b!r} share bytes of {name!r}")


def _parse_entry(key: str, e: object, files: Mapping[str, FileEntry], where: str) -> TensorEntry:
    _want(isinstance(e, dict), where, f"entry {key!r} must be an object")
    assert isinstance(e, dict)
    dtype = e.get("dtype")
    item = itemsize(dtype, f"entry {key!r} of manifest {where}")
    assert isinstance(dtype, str)
    shape = _ints(e.get("shape"), where, f"shape of {key!r}")
    _sized(shape, item, where, key)
    if "alias_of" in e:
        _want(isinstance(e["alias_of"], str), where, f"alias_of of {key!r} must be a string")
        return TensorEntry(key, dtype, shape, (), e["alias_of"])
    chunks_doc = e.get("chunks")
    _want(isinstance(chunks_doc, list) and len(chunks_doc) > 0, where, f"{key!r} has no chunks")
    assert isinstance(chunks_doc, list)
    chunks = []
    for c in chunks_doc:
        _want(isinstance(c, dict), where, f"chunk of {key!r} must be an object")
        fname = safe_file_name(c.get("file"), where)
        _want(fname in files, where, f"{key!r} refers to unlisted file {fname!r}")
        offsets = _ints(c.get("offsets"), where, f"offsets of {key!r}")
        cshape = _ints(c.get("shape"), where, f"chunk shape of {key!r}")
        _want(len(offsets) == len(shape) == len(cshape), where, f"rank mismatch in {key!r}")
        _want(all(o + n <= s for o, n, s in zip(offsets, cshape, shape)), where, f"chunk of {key!r} out of bounds")
        start = _int(c.get("start"), where, f"start of {key!r}")
        end = _int(c.get("end"), where, f"end of {key!r}")
        numel = 1
        for n in cshape:
            numel *= n
        fe = files[fname]
        _want(end - start == numel * item, where, f"byte range of {key!r} does not match its shape")
        _want(fe.data_start <= start <= end <= fe.size, where, f"byte range of {key!r} is outside {fname!r}")
        sums = c.get("checksums")
        ok = isinstance(sums, list) and len(sums) == block_count(end - start, CHECKSUM_BLOCK_BYTES)
        _want(ok and all(isinstance(x, str) for x in sums), where, f"checksums of {key!r} do not match its size")
        chunks.append(Chunk(fname, offsets, cshape, start, end, tuple(sums)))
    return TensorEntry(key, dtype, shape, tuple(chunks))
