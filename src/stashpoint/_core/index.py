"""Format version 2: each rank's index beside its data, and a small manifest that names them.

A version-1 manifest lists every chunk of every rank: it grows with ranks x tensors, rank 0
rebuilds it on every save and every loader parses all of it. In version 2 each rank writes an
*index* of what it wrote (its files, each chunk's byte range and checksums, its state tree), and
the manifest, written last by rank 0, holds only:

* ``indexes``: each rank's index by size and checksum (one short entry per rank);
* ``tensors``: the *catalog*, per tensor its dtype and global shape and where its chunks are:
  a :class:`Grid` (regular layouts, e.g. FSDP2's even row blocks: a few numbers whatever the
  world size) or, for irregular layouts, each chunk's box and writing rank.

A loader reads the manifest and then only the indexes of the ranks whose chunks overlap what it
needs (same world size: its own, and rank 0's for small replicated tensors). See docs/FORMAT.md.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _str
from typing import Any

from stashpoint._core.assign import merge_trees
from stashpoint._core.catalog import Grid, Placement
from stashpoint._core.dtypes import ITEMSIZE
from stashpoint._core.format import Chunk, FileEntry, Manifest, TensorEntry, _check_byte_ranges, _check_tiling, parse_v1
from stashpoint._core.header import HEADER_ALIGN, MAX_HEADER_BYTES
from stashpoint._core.naming import group_dir, index_name, parse_shard_name, placed
from stashpoint._core.nodes import check_tree
from stashpoint._core.reshard import Box, block_count
from stashpoint._core.sealed import (
    CHECKSUM_ALGORITHM,
    CHECKSUM_BLOCK_BYTES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_MANIFEST_ENTRIES,
    _body,
    _fail,
    _int,
    _ints,
    _sized,
    _want,
    common_fields,
    open_sealed,
    safe_file_name,
    seal,
)
from stashpoint.errors import CorruptCheckpointError

INDEX_FORMAT = "stashpoint-index"
_SAVE_ID = re.compile(r"[0-9a-f]{1,64}")
MAX_WORLD = 1 << 24
# chunks the catalog's grids may describe in all, per rank of the world (and a million at any
# world size): 65,536 tensors sharded over every rank. Bounds what a load that plans every chunk
# may enumerate to what a real checkpoint of that world size could hold
CELLS_PER_RANK = 1 << 16

# ---------------------------------------------------------------------------------------------
# The manifest (rank 0, written last) and the indexes (one per rank)


@dataclass(frozen=True)
class Head:
    """A version-2 manifest: the commit record, the catalog and the list of indexes."""

    save_id: str
    created: str
    library_version: str
    torch_version: str
    world_size: int
    indexes: tuple[tuple[int, str], ...]  # per rank: its index's size and checksum
    catalog: Mapping[str, Placement]
    metadata: Mapping[str, str] = field(default_factory=dict)
    ranks_per_dir: int = 0  # each rank's files are in its group directory (0: all at the root)

    def index_name(self, rank: int) -> str:
        return placed(index_name(rank, self.save_id), rank, self.ranks_per_dir)

    def to_json(self, encoded_catalog: bytes | None = None) -> bytes:
        """The sealed manifest; ``encoded_catalog``: ``catalog_json(self.catalog)``, where the
        caller has it already (a plan's, encoded once for every save of it)."""
        return seal(
            {
                "format": FORMAT_NAME,
                "format_version": FORMAT_VERSION,
                "save_id": self.save_id,
                "created": self.created,
                "library_version": self.library_version,
                "torch_version": self.torch_version,
                "world_size": self.world_size,
                "ranks_per_dir": self.ranks_per_dir,
                "checksum_algorithm": CHECKSUM_ALGORITHM,
                "checksum_block_bytes": CHECKSUM_BLOCK_BYTES,
                "metadata": dict(self.metadata),
                "indexes": [[size, sums] for size, sums in self.indexes],
            },
            {"tensors": catalog_json(self.catalog) if encoded_catalog is None else encoded_catalog},
        )


def catalog_json(catalog: Mapping[str, Placement]) -> bytes:
    """The manifest's ``tensors`` field, compact JSON (as ``json.dumps`` with ``(",", ":")``
    writes it): a plan's is encoded once for every save of it. Written as text, not through a
    dict and lists per tensor: tens of thousands of containers set off collections of the heap."""
    return ("{" + ",".join(f"{_str(k)}:{_placement_json(p)}" for k, p in catalog.items()) + "}").encode()


def _placement_json(p: Placement) -> str:
    head = f'{{"dtype":{_str(p.dtype)},"shape":{_ints_json(p.shape)}'
    if p.alias_of is not None:
        return f'{head},"alias_of":{_str(p.alias_of)}}}'
    if p.grid is not None:
        g = p.grid
        return f'{head},"grid":{{"block":{_ints_json(g.block)},"base":{g.base},"strides":{_ints_json(g.strides)}}}}}'
    cells = ",".join(f"[{_ints_json(o)},{_ints_json(s)},{w}]" for o, s, w in p.cells)
    return f'{head},"chunks":[{cells}]}}'


def _ints_json(v: tuple[int, ...]) -> str:
    return "[" + ",".join(map(str, v)) + "]"


@dataclass(frozen=True)
class RankIndex:
    """What one rank wrote: its files, the chunk of each key it wrote, and its state tree."""

    rank: int
    save_id: str
    files: tuple[FileEntry, ...]
    chunks: Mapping[str, Chunk]
    tree: dict[str, Any]

    def to_json(self) -> bytes:
        number = {f.name: i for i, f in enumerate(self.files)}
        rows = (
            (k, number[c.file], box_json(c.offsets, c.shape), c.start, c.end, c.checksums)
            for k, c in self.chunks.items()
        )
        return index_json(self.rank, self.save_id, self.files, rows, self.tree)


def box_json(offsets: tuple[int, ...], shape: tuple[int, ...]) -> str:
    """A chunk's offsets and shape as an index row holds them: ``[0,0],[4,2]``."""
    return f"{_ints_json(offsets)},{_ints_json(shape)}"


def index_json(
    rank: int,
    save_id: str,
    files: tuple[FileEntry, ...],
    rows: Iterable[tuple[str, int, str, int, int, Sequence[str]]],
    tree: dict[str, Any],
) -> bytes:
    """A rank's index, sealed: ``rows`` gives each chunk's key, file number, :func:`box_json`,
    start, end and block checksums. Its rows are written as text (as ``json.dumps`` writes
    them), not through a list per chunk: tens of thousands set off collections of the heap."""
    chunks = ",".join(
        f"{_str(k)}:[{n},{box},{start},{end},[{','.join(map(_str, sums))}]]" for k, n, box, start, end, sums in rows
    )
    return seal(
        {
            "format": INDEX_FORMAT,
            "format_version": FORMAT_VERSION,
            "save_id": save_id,
            "rank": rank,
            "checksum_algorithm": CHECKSUM_ALGORITHM,
            "checksum_block_bytes": CHECKSUM_BLOCK_BYTES,
            "files": [[f.name, f.size, f.data_start, f.header_checksum] for f in files],
        },
        {"chunks": ("{" + chunks + "}").encode("ascii"), "tree": _body(tree)},
    )


def parse_head(raw: bytes, where: str) -> Manifest | Head:
    """A manifest of either version: version 1 whole, version 2 as its :class:`Head`."""
    doc, version = open_sealed(raw, where)
    if version == 1:
        return parse_v1(doc, where)
    head = common_fields(doc, where)
    world = _int(doc.get("world_size"), where, "world_size", 1)
    _want(world <= MAX_WORLD, where, f"world_size is over {MAX_WORLD}")
    # the save id and the group size make the indexes' file names: nothing else may get in
    _want(_SAVE_ID.fullmatch(head["save_id"]) is not None, where, "save_id must be 1 to 64 hex digits")
    per_dir = _int(doc.get("ranks_per_dir", 0), where, "ranks_per_dir")
    _want(per_dir <= MAX_WORLD, where, f"ranks_per_dir is over {MAX_WORLD}")
    refs = doc.get("indexes")
    _want(isinstance(refs, list) and len(refs) == world, where, "indexes must list one index per rank")
    assert isinstance(refs, list)
    indexes = []
    for ref in refs:
        ok = isinstance(ref, list) and len(ref) == 2 and isinstance(ref[1], str)
        _want(ok, where, "an index entry must be [size, checksum]")
        indexes.append((_int(ref[0], where, "index size"), ref[1]))
    tensors = doc.get("tensors")
    _want(isinstance(tensors, dict), where, "tensors must be an object")
    assert isinstance(tensors, dict)
    cells = sum(len(c) for e in tensors.values() if isinstance(e, dict) and isinstance(c := e.get("chunks"), list))
    _want(cells + world <= MAX_MANIFEST_ENTRIES, where, f"it lists {cells} chunks (the cap is {MAX_MANIFEST_ENTRIES})")
    catalog = {key: _parse_placement(key, e, world, where) for key, e in tensors.items()}
    grid_cells = sum(math.prod(p.grid.counts(p.shape)) for p in catalog.values() if p.grid is not None)
    cap = max(MAX_MANIFEST_ENTRIES, world * CELLS_PER_RANK)
    _want(grid_cells <= cap, where, f"its grids hold {grid_cells} chunks (the cap at this world size is {cap})")
    for key, p in catalog.items():
        if p.alias_of is not None:
            target = catalog.get(p.alias_of)
            _want(target is not None and target.alias_of is None, where, f"{key!r} aliases a missing entry")
            assert target is not None
            _want((target.dtype, target.shape) == (p.dtype, p.shape), where, f"{key!r} aliases another dtype or shape")
    return Head(world_size=world, indexes=tuple(indexes), catalog=catalog, ranks_per_dir=per_dir, **head)


def _parse_placement(key: str, e: object, world: int, where: str) -> Placement:
    # per entry: each check's message is formatted only when it fails
    if type(e) is not dict:
        _fail(where, f"entry {key!r} must be an object")
    dtype = e.get("dtype")
    if type(dtype) is not str or dtype not in ITEMSIZE:
        raise CorruptCheckpointError(f"unknown dtype {dtype!r} in entry {key!r} of manifest {where}")
    shape = _ints(e.get("shape"), where, "shape", key=key)
    _sized(shape, ITEMSIZE[dtype], where, key)
    if "alias_of" in e:
        if type(e["alias_of"]) is not str:
            _fail(where, f"alias_of of {key!r} must be a string")
        return Placement(key, dtype, shape, alias_of=e["alias_of"])
    if "grid" in e:
        return _parse_grid(key, e["grid"], dtype, shape, world=world, where=where)
    doc = e.get("chunks")
    if type(doc) is not list:
        _fail(where, f"{key!r} has neither a grid nor chunks")
    cells = []
    for c in doc:
        if not (type(c) is list and len(c) == 3):
            _fail(where, f"a chunk of {key!r} must be [offsets, shape, rank]")
        off, shp = _ints(c[0], where, "offsets", key=key), _ints(c[1], where, "chunk shape", key=key)
        writer = _int(c[2], where, "rank of a chunk", key=key)
        if not (writer < world and len(off) == len(shp) == len(shape)):
            _fail(where, f"a chunk of {key!r} is malformed")
        if not all(o + n <= s for o, n, s in zip(off, shp, shape)):
            _fail(where, f"chunk of {key!r} out of bounds")
        cells.append((off, shp, writer))
    if len({w for _, shp, w in cells if math.prod(shp)}) != sum(1 for _, shp, _ in cells if math.prod(shp)):
        _fail(where, f"{key!r} gives a rank two chunks (an index holds one chunk of a tensor)")
    boxes = tuple(Chunk("", o, s, 0, 0, ()) for o, s, _ in cells)
    _check_tiling(TensorEntry(key, dtype, shape, boxes), where)
    return Placement(key, dtype, shape, None, tuple(cells))


def _parse_grid(key: str, g: object, dtype: str, shape: tuple[int, ...], *, world: int, where: str) -> Placement:
    if type(g) is not dict:
        _fail(where, f"grid of {key!r} must be an object")
    block = _ints(g.get("block"), where, "grid block", key=key)
    strides = g.get("strides")
    if not (type(strides) is list and len(block) == len(shape) == len(strides)):
        _fail(where, f"grid of {key!r} does not match its shape")
    for s in strides:
        if type(s) is not int:
            _fail(where, f"grid of {key!r} does not match its shape")
    if 0 in block or 0 in shape:
        _fail(where, f"grid of {key!r} has an empty block")
    grid = Grid(block, _int(g.get("base"), where, "grid base", key=key), tuple(strides))
    if block == shape:  # one cell, the tensor saved whole (most entries): written by ``base``
        if grid.base >= world:
            _fail(where, f"grid of {key!r} names ranks outside the world")
        return Placement(key, dtype, shape, grid)
    counts = grid.counts(shape)
    if math.prod(counts) > world:  # each rank's index holds one chunk of a tensor
        _fail(where, f"grid of {key!r} has {math.prod(counts)} cells, more than the {world} ranks could write")
    lo = grid.base + sum(min(0, s * (c - 1)) for s, c in zip(grid.strides, counts))
    hi = grid.base + sum(max(0, s * (c - 1)) for s, c in zip(grid.strides, counts))
    if not (lo >= 0 and hi < world):
        _fail(where, f"grid of {key!r} names ranks outside the world")
    return Placement(key, dtype, shape, grid)


def parse_index(raw: bytes, where: str, head: Head, rank: int) -> RankIndex:
    """Rank ``rank``'s index of the save ``head`` commits, validated against its catalog: every
    chunk is one the catalog gives this rank, inside its file, with a checksum per block."""
    doc, _ = open_sealed(raw, where, INDEX_FORMAT)
    own = doc.get("save_id") == head.save_id and type(doc.get("rank")) is int and doc["rank"] == rank
    _want(own, where, "it is another save's or rank's")
    files_doc, chunks_doc = doc.get("files"), doc.get("chunks")
    _want(isinstance(files_doc, list) and isinstance(chunks_doc, dict), where, "files and chunks are missing")
    assert isinstance(files_doc, list) and isinstance(chunks_doc, dict)
    _want(len(files_doc) + len(chunks_doc) <= MAX_MANIFEST_ENTRIES, where, "it lists too many chunks")
    files = []
    own_dir = group_dir(rank, head.ranks_per_dir)
    for f in files_doc:
        _want(isinstance(f, list) and len(f) == 4 and isinstance(f[3], str), where, "a file entry is malformed")
        name = safe_file_name(f[0], where)
        _want(name.rpartition("/")[0] == own_dir, where, f"{name!r} is outside rank {rank}'s directory {own_dir!r}")
        # a shard's name carries its rank and save: no two indexes can claim one file's bytes
        shard = parse_shard_name(name.rpartition("/")[2])
        if shard is None or shard[0] != rank or shard[2] != head.save_id:
            _fail(where, f"{name!r} is not the name of a shard of rank {rank} in this save")
        size = _int(f[1], where, f"size of {name!r}")
        start = _int(f[2], where, f"data_start of {name!r}", 8)
        _want(start <= size and start <= 8 + MAX_HEADER_BYTES + HEADER_ALIGN, where, f"data_start of {name!r}")
        files.append(FileEntry(name, size, start, f[3], rank))
    _want(len({f.name for f in files}) == len(files), where, "a file is listed twice")
    chunks: dict[str, Chunk] = {}
    for key, c in chunks_doc.items():  # per chunk: each message is formatted only when it fails
        p = head.catalog.get(key)
        if p is None or p.alias_of is not None:
            _fail(where, f"{key!r} is not a stored tensor of the catalog")
        if not (type(c) is list and len(c) == 6 and type(c[0]) is int and 0 <= c[0] < len(files)):
            _fail(where, f"the chunk of {key!r} is malformed")
        fe = files[c[0]]
        off, shp = _ints(c[1], where, "offsets", key=key), _ints(c[2], where, "chunk shape", key=key)
        start, end = _int(c[3], where, "start", key=key), _int(c[4], where, "end", key=key)
        if not len(off) == len(shp) == len(p.shape):
            _fail(where, f"the chunk of {key!r} has other dimensions than its tensor")
        numel = math.prod(shp)
        if not (numel == 0 or p.expects(Box(off, shp), rank)):
            _fail(where, f"the catalog does not give {key!r} {off} here")
        if end - start != numel * ITEMSIZE[p.dtype]:  # the catalog's dtypes are known ones
            _fail(where, f"byte range of {key!r} does not match its shape")
        if not fe.data_start <= start <= end <= fe.size:
            _fail(where, f"byte range of {key!r} is outside {fe.name!r}")
        sums = c[5]
        ok = type(sums) is list and len(sums) == block_count(end - start, CHECKSUM_BLOCK_BYTES)
        if not (ok and all(type(x) is str for x in sums)):
            _fail(where, f"checksums of {key!r} do not match its size")
        chunks[key] = Chunk(fe.name, off, shp, start, end, tuple(sums))
    _check_byte_ranges(chunks.items(), where)
    tree = doc.get("tree")
    try:
        check_tree(tree, head.catalog, where, 0)
    except RecursionError:
        raise CorruptCheckpointError(f"malformed index {where}: tree nested too deeply") from None
    assert isinstance(tree, dict)
    return RankIndex(rank, head.save_id, tuple(files), chunks, tree)


def assemble(head: Head, indexes: Mapping[int, RankIndex], tree_rank: int | None = None) -> Manifest:
    """A :class:`Manifest` of what ``indexes`` hold: every tensor of the catalog, with the
    chunks of the given ranks (all ranks: the whole checkpoint). Its trees are those of every
    given rank, or of ``tree_rank`` alone (a load's own, whatever its rank in the saving world)."""
    chunks: dict[str, list[Chunk]] = {}
    for rank in sorted(indexes):
        for key, c in indexes[rank].chunks.items():
            chunks.setdefault(key, []).append(c)
    tensors = {
        k: TensorEntry(k, p.dtype, p.shape, tuple(sorted(chunks.get(k, ()), key=lambda c: c.offsets)), p.alias_of)
        for k, p in head.catalog.items()
    }
    trees: tuple[dict[str, Any], ...]
    of_rank: tuple[int, ...]
    if tree_rank is not None:
        trees, of_rank = (indexes[tree_rank].tree,), (0,)
    else:
        trees, of_rank = merge_trees([indexes[r].tree for r in sorted(indexes)])
    return Manifest(
        save_id=head.save_id,
        created=head.created,
        library_version=head.library_version,
        torch_version=head.torch_version,
        files=tuple(f for r in sorted(indexes) for f in indexes[r].files),
        tensors=tensors,
        trees=trees,
        metadata=head.metadata,
        world_size=head.world_size,
        tree_of_rank=of_rank,
        format_version=FORMAT_VERSION,
        indexes=tuple((head.index_name(r), head.indexes[r][0]) for r in sorted(indexes)),
    )
