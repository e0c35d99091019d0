"""The persist phase: write staged bytes to shard files with checksums, durably."""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ._format import FileEntry, block_checksums, checksum, encode_header, safetensors_view
from ._plan import FilePlan, shard_name
from ._staging import as_memoryview
from ._storage import FileWriter, Storage

_WRITE_BLOCK = 64 * 1024 * 1024


@dataclass(frozen=True)
class WrittenShards:
    """What the persist phase of one rank produced."""

    files: tuple[FileEntry, ...]
    # key -> (file name, absolute start, absolute end, block checksums)
    chunks: Mapping[str, tuple[str, int, int, tuple[str, ...]]]
    bytes_written: int


def _span(addr: int, n: int) -> memoryview:
    return memoryview((ctypes.c_char * n).from_address(addr)).cast("B") if n else memoryview(b"")


def _write_run(writer: FileWriter, mv: memoryview) -> None:
    for b in range(0, len(mv), _WRITE_BLOCK):
        writer.write(mv[b : b + _WRITE_BLOCK])


def write_shards(
    storage: Storage,
    files: Sequence[FilePlan],
    views: Mapping[str, torch.Tensor],
    *,
    rank: int,
    save_id: str,
    dtypes: Mapping[str, torch.dtype],
    shapes: Mapping[str, tuple[int, ...]],
) -> WrittenShards:
    """Write each planned shard durably from the staged ``views`` (contiguous host tensors).

    Tensors that lie back to back in staging memory are written as one run in large aligned
    blocks (direct I/O where the storage allows); checksums are computed in the same pass.
    """
    entries_out: list[FileEntry] = []
    chunks: dict[str, tuple[str, int, int, tuple[str, ...]]] = {}
    written = 0
    for fplan in files:
        name = shard_name(rank, fplan.index, save_id)
        entries = []
        for p in fplan.placements:
            st_dtype, st_shape = safetensors_view(dtypes[p.key], shapes[p.key], p.end - p.begin)
            entries.append((p.key, st_dtype, st_shape, p.begin, p.end))
        header = encode_header(entries, {"format": "stashpoint", "save_id": save_id})
        size = len(header) + fplan.data_size
        writer = storage.open_writer(name, size)
        try:
            writer.write(header)
            run_addr = run_end = 0
            for p in fplan.placements:
                mv = as_memoryview(views[p.key])
                chunks[p.key] = (name, len(header) + p.begin, len(header) + p.end, block_checksums(mv))
                addr = views[p.key].data_ptr()
                if run_end and addr == run_end:
                    run_end += len(mv)
                    continue
                if run_end:
                    _write_run(writer, _span(run_addr, run_end - run_addr))
                run_addr, run_end = addr, addr + len(mv)
                if not len(mv):
                    run_addr = run_end = 0
            if run_end:
                _write_run(writer, _span(run_addr, run_end - run_addr))
            writer.close()
        except BaseException:
            writer.abort()
            raise
        written += size
        entries_out.append(FileEntry(name, size, len(header), checksum(header), rank))
    return WrittenShards(tuple(entries_out), chunks, written)
