"""The persist phase: write staged bytes to shard files with checksums, durably.

The shard files' contents are decided here, in the training process (headers, which bytes of
staging memory go where); the bytes are then written by ``_shardio.write_files`` — on the writer
thread, or in the writer process (``_writerproc``), which maps the same staging memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from stashpoint._core.dtypes import safetensors_view
from stashpoint._core.format import CHECKSUM_BLOCK_BYTES, FileEntry, checksum
from stashpoint._core.header import encode_entries, encode_header
from stashpoint._core.naming import shard_name
from stashpoint._core.plan import FilePlan
from stashpoint._save.shardio import Piece, ShardWrite, write_files
from stashpoint._save.staging import StagingBuffers
from stashpoint._storage import Storage


@dataclass(frozen=True)
class WrittenShards:
    """What the persist phase of one rank produced."""

    files: tuple[FileEntry, ...]
    # key -> (file name, absolute start, absolute end, block checksums)
    chunks: Mapping[str, tuple[str, int, int, tuple[str, ...]]]
    bytes_written: int


class Writer(Protocol):
    """Writes planned shard files out of staging memory somewhere else (the writer process)."""

    def write(
        self, storage: Storage, writes: Sequence[ShardWrite], staged: StagingBuffers, *, block: int
    ) -> dict[str, tuple[str, ...]]:
        """Like ``_shardio.write_files`` on ``staged``'s memory: the block checksums by key."""
        ...


@dataclass(frozen=True)
class FileLayout:
    """What a shard file holds whatever the save: its header's tensor fields (encoded), and
    where each tensor's bytes lie in staging memory."""

    entries: bytes  # ``encode_entries`` of the file's tensors
    pieces: tuple[Piece, ...]


def file_layouts(files: Sequence[FilePlan], staged: StagingBuffers) -> tuple[FileLayout, ...]:
    """The :class:`FileLayout` of each of ``files`` in ``staged`` (any plan's layout of the same
    tensors): the same for every save of a structure, so a caller may keep them."""
    out = []
    specs = {s.key: s for s in staged.specs}  # what each view was made of: no torch call per tensor
    for fplan in files:
        entries = []
        for p in fplan.placements:
            spec = specs[p.key]
            st_dtype, st_shape = safetensors_view(spec.dtype, spec.shape, p.end - p.begin)
            entries.append((p.key, st_dtype, st_shape, p.begin, p.end))
        pieces = tuple(Piece(p.key, staged.offsets[p.key], p.end - p.begin) for p in fplan.placements)
        out.append(FileLayout(encode_entries(entries), pieces))
    return tuple(out)


def shard_writes(
    files: Sequence[FilePlan],
    staged: StagingBuffers,
    *,
    rank: int,
    save_id: str,
    directory: str = "",
    layouts: Sequence[FileLayout] | None = None,
) -> list[ShardWrite]:
    """The shard files of ``files`` (in ``directory`` under the checkpoint): each one's
    safetensors header, and where each tensor's bytes lie in ``staged`` (``layouts``, where
    the caller kept them: ``file_layouts(files, staged)``)."""
    writes = []
    for fplan, fl in zip(files, file_layouts(files, staged) if layouts is None else layouts):
        header = encode_header(fl.entries, {"format": "stashpoint", "save_id": save_id})
        name = shard_name(rank, fplan.index, save_id)
        writes.append(ShardWrite(f"{directory}/{name}" if directory else name, header, fl.pieces))
    return writes


def write_shards(
    storage: Storage,
    files: Sequence[FilePlan],
    staged: StagingBuffers,
    *,
    rank: int,
    save_id: str,
    writer: Writer | None = None,
    directory: str = "",
    layouts: Sequence[FileLayout] | None = None,
) -> WrittenShards:
    """Write each planned shard durably from ``staged``, on this thread or with ``writer``.

    Tensors that lie back to back in staging memory are written as one run in large aligned
    blocks (direct I/O where the storage allows); checksums are computed in the same pass.
    """
    writes = shard_writes(files, staged, rank=rank, save_id=save_id, directory=directory, layouts=layouts)
    if writer is None or not writes:
        sums = write_files(storage, writes, staged.memoryview(), block=CHECKSUM_BLOCK_BYTES)
    else:
        sums = writer.write(storage, writes, staged, block=CHECKSUM_BLOCK_BYTES)
    entries: list[FileEntry] = []
    chunks: dict[str, tuple[str, int, int, tuple[str, ...]]] = {}
    for w, fplan in zip(writes, files):
        hlen = len(w.header)
        for p in fplan.placements:
            chunks[p.key] = (w.name, hlen + p.begin, hlen + p.end, sums[p.key])
        entries.append(FileEntry(w.name, w.size, hlen, checksum(w.header), rank))
    return WrittenShards(tuple(entries), chunks, sum(w.size for w in writes))
