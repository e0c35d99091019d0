"""The persist phase: write staged bytes to storage with checksums, then commit the manifest."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ._format import FileEntry, block_checksums, checksum, encode_header, safetensors_view
from ._plan import SavePlan, shard_name
from ._staging import StagingBuffers, as_memoryview
from ._storage import FileWriter, Storage

_WRITE_BLOCK = 64 * 1024 * 1024


@dataclass(frozen=True)
class WrittenShards:
    """What the persist phase of one rank produced."""

    files: tuple[FileEntry, ...]
    # key -> (file name, absolute start, absolute end, block checksums)
    chunks: Mapping[str, tuple[str, int, int, tuple[str, ...]]]
    bytes_written: int
    seconds: float


def write_shards(
    storage: Storage,
    staged: StagingBuffers,
    save_id: str,
    dtypes: Mapping[str, torch.dtype],
    shapes: Mapping[str, tuple[int, ...]],
    *,
    on_progress: Callable[[int], None] | None = None,
) -> WrittenShards:
    """Write every shard of ``staged`` durably; checksums are computed in the same pass."""
    t0 = time.perf_counter()
    plan: SavePlan = staged.plan
    files: list[FileEntry] = []
    chunks: dict[str, tuple[str, int, int, tuple[str, ...]]] = {}
    written = 0
    for fplan, buf in zip(plan.files, staged.buffers):
        name = shard_name(plan.rank, fplan.index, save_id)
        entries = []
        for p in fplan.placements:
            st_dtype, st_shape = safetensors_view(dtypes[p.key], shapes[p.key], p.end - p.begin)
            entries.append((p.key, st_dtype, st_shape, p.begin, p.end))
        header = encode_header(entries, {"format": "stashpoint", "save_id": save_id})
        size = len(header) + fplan.data_size
        mv = as_memoryview(buf)
        writer: FileWriter = storage.open_writer(name, size)
        try:
            writer.write(header)
            # Checksums per tensor; writes in fixed aligned blocks as soon as checksums cover them,
            # so every write but the last starts and ends on a direct-I/O boundary.
            done = 0
            for p in fplan.placements:
                chunks[p.key] = (name, len(header) + p.begin, len(header) + p.end, block_checksums(mv[p.begin : p.end]))
                while p.end - done >= _WRITE_BLOCK:
                    writer.write(mv[done : done + _WRITE_BLOCK])
                    done += _WRITE_BLOCK
                    if on_progress:
                        on_progress(_WRITE_BLOCK)
            if done < fplan.data_size:
                writer.write(mv[done : fplan.data_size])
                if on_progress:
                    on_progress(fplan.data_size - done)
            writer.close()
        except BaseException:
            writer.abort()
            raise
        written += size
        files.append(FileEntry(name, size, len(header), checksum(header), plan.rank))
    return WrittenShards(tuple(files), chunks, written, time.perf_counter() - t0)
