"""Writing shard files out of staging memory: several files at once, the same bytes as one by one."""

from __future__ import annotations

import errno
import mmap
import os

import pytest

from stashpoint._save.shardio import Piece, ShardWrite, block_sums, write_files
from stashpoint._storage import FileWriter, LocalStorage

BLOCK = 1 << 20


def _memory(n: int) -> memoryview:
    m = mmap.mmap(-1, n)
    m[:] = os.urandom(n)
    return memoryview(m)


def _writes(n_files: int) -> list[ShardWrite]:
    """Files of adjacent and scattered pieces, an empty piece, an unaligned one."""
    out = []
    for i in range(n_files):
        base = i * (3 << 20)
        pieces = (
            Piece(f"f{i}/a", base, 1 << 20),
            Piece(f"f{i}/b", base + (1 << 20), 12345),  # adjacent: one run with a
            Piece(f"f{i}/empty", base + (2 << 20), 0),
            Piece(f"f{i}/c", base + (2 << 20) + 4096, 700_000),  # a gap before it: a run of its own
        )
        out.append(ShardWrite(f"shard-{i}.safetensors", b"H" * 4096, pieces))
    return out


def test_several_files_at_once_write_what_one_by_one_writes(tmp_path):
    memory = _memory(4 * (3 << 20))
    writes = _writes(4)
    serial, parallel = LocalStorage(tmp_path / "serial"), LocalStorage(tmp_path / "parallel")
    for s in (serial, parallel):
        s.prepare()
    sums1 = write_files(serial, writes, memory, block=BLOCK, streams=1)
    sums4 = write_files(parallel, writes, memory, block=BLOCK, streams=4)
    assert sums1 == sums4
    for w in writes:
        data = (tmp_path / "parallel" / w.name).read_bytes()
        assert data == (tmp_path / "serial" / w.name).read_bytes()
        expected = w.header + b"".join(bytes(memory[p.offset : p.offset + p.nbytes]) for p in w.pieces)
        assert data == expected and len(data) == w.size
        for p in w.pieces:
            assert sums4[p.key] == block_sums(memory[p.offset : p.offset + p.nbytes], BLOCK)


class _FullAt(LocalStorage):
    """A real local storage whose disk is full for one file (ENOSPC while writing it)."""

    bad = "shard-1.safetensors"

    def open_writer(self, name: str, size: int) -> FileWriter:
        writer = super().open_writer(name, size)
        if name != self.bad:
            return writer
        real_write = writer.write

        def write(data):  # type: ignore[no-untyped-def]
            real_write(data)
            raise OSError(errno.ENOSPC, "No space left on device")

        writer.write = write  # type: ignore[method-assign]
        return writer


@pytest.mark.parametrize("streams", [1, 3])
def test_a_failed_file_is_removed_and_its_error_raised(tmp_path, streams):
    memory = _memory(3 * (3 << 20))
    s = _FullAt(tmp_path / "ck")
    s.prepare()
    with pytest.raises(OSError, match="No space left"):
        write_files(s, _writes(3), memory, block=BLOCK, streams=streams)
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert _FullAt.bad not in names, "the failed file is aborted"
    if streams > 1:  # the others were written whole meanwhile (the save's clean-up removes them)
        assert names == ["shard-0.safetensors", "shard-2.safetensors"]


def test_write_streams_is_an_option_of_the_local_backend(tmp_path):
    import torch

    import stashpoint
    from stashpoint._save.writerchild import storage_from
    from stashpoint._save.writerproc import describe

    s = LocalStorage(tmp_path / "ck", write_streams=3)
    assert LocalStorage("x").write_streams == 2, "two files at a time unless asked otherwise"
    assert s.child("a").write_streams == 3 and storage_from(describe(s)).write_streams == 3
    with pytest.raises(ValueError, match="write_streams must be a whole number of at least 1, got 0"):
        LocalStorage("x", write_streams=0)
    state = {f"t{i}": torch.randn(1000) for i in range(5)}
    for writer in ("thread", "process"):
        path = tmp_path / writer
        stashpoint.save(state, LocalStorage(path, write_streams=3), max_shard_bytes=8000, writer=writer)
        assert len(list(path.glob("shard-*"))) == 3
        back = {k: torch.zeros(1000) for k in state}
        stashpoint.load(back, path)
        assert all(torch.equal(back[k], state[k]) for k in state)
