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
from stashpoint._core.header import encode_header
from stashpoint._core.naming import shard_name
from stashpoint._core.plan import FilePlan
from stashpoint._save.shardio import Piece, ShardWrite, write_files
from stashpoint._save.staging import StagingBuffers
from stashpoint._state.dtypes import dtype_name
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


def shard_writes(
    files: Sequence[FilePlan], staged: StagingBuffers, *, rank: int, save_id: str, directory: str = ""
) -> list[ShardWrite]:
    """The shard files of ``files`` (in ``directory`` under the checkpoint): each one's
    safetensors header, and where each tensor's bytes lie in ``staged`` (any plan's layout of
    the same tensors)."""
    writes = []
    for fplan in files:
        entries = []
        for p in fplan.placements:
            view = staged.views[p.key]
            st_dtype, st_shape = safetensors_view(dtype_name(view.dtype), tuple(view.shape), p.end - p.begin)
            entries.append((p.key, st_dtype, st_shape, p.begin, p.end))
        header = encode_header(entries, {"format": "stashpoint", "save_id": save_id})
        pieces = tuple(Piece(p.key, staged.offsets[p.key], p.end - p.begin) for p in fplan.placements)
        name = shard_name(rank, fplan.index, save_id)
        writes.append(ShardWrite(f"{directory}/{name}" if directory else name, header, pieces))
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
) -> WrittenShards:
    """Write each planned shard durably from ``staged``, on this thread or with ``writer``.

    Tensors that lie back to back in staging memory are written as one run in large aligned
    blocks (direct I/O where the storage allows); checksums are computed in the same pass.
    """
    writes = shard_writes(files, staged, rank=rank, save_id=save_id, directory=directory)
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
