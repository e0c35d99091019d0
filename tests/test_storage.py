"""Conformance tests for storage backends: every backend subclasses StorageSuite and passes it."""

from __future__ import annotations

import mmap
import os
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stashpoint._state.dtypes import as_memoryview
from stashpoint._storage import LocalStorage, Storage, storage_for
from stashpoint._storage.local import DIRECT_ALIGN


def _aligned(n: int) -> memoryview:
    m = mmap.mmap(-1, max(n, 1))
    return memoryview(m)[:n]


class StorageSuite:
    """Behaviour every backend must have. Subclasses provide ``make(path)``."""

    def make(self, path: Path) -> Storage:
        raise NotImplementedError

    def test_write_in_pieces_then_read_back(self, tmp_path):
        s = self.make(tmp_path / "ck")
        s.prepare()
        payload = os.urandom(3 * DIRECT_ALIGN + 123)
        buf = _aligned(len(payload))
        buf[:] = payload
        w = s.open_writer("f.bin", len(payload))
        w.write(b"abc")  # unaligned start, then aligned memory at an unaligned offset
        w.write(buf[3 : 2 * DIRECT_ALIGN])
        w.write(buf[2 * DIRECT_ALIGN :])
        w.close()
        assert s.size("f.bin") == len(payload) - 3 + 3
        assert s.read("f.bin") == b"abc" + payload[3:]
        out = bytearray(100)
        s.read_into("f.bin", 50, memoryview(out))
        assert bytes(out) == (b"abc" + payload[3:])[50:150]
        assert s.read("f.bin", 10, 5) == (b"abc" + payload[3:])[10:15]

    def test_the_cache_hint_is_a_bool_and_never_an_error(self, tmp_path):
        s = self.make(tmp_path / "ck")
        s.prepare()
        s.commit("f", b"x" * 5000)
        assert s.cached("f", 0) in (True, False) and s.cached("f", 4999) in (True, False)
        assert s.cached("missing", 0) is False and s.cached("f", 1 << 40) is False

    def test_a_listing_names_a_committed_file_and_no_other(self, tmp_path):
        s = self.make(tmp_path / "ck")
        s.prepare()
        assert not s.listed("manifest.json")
        s.commit("manifest.json.partial", b"x")  # a name that only starts like it
        assert not s.listed("manifest.json")
        s.commit("manifest.json", b"{}")
        assert s.listed("manifest.json") and s.listed("manifest.json.partial") and not s.listed("other")

    def test_read_past_the_end_raises(self, tmp_path):
        s = self.make(tmp_path / "ck")
        s.prepare()
        w = s.open_writer("f", 4)
        w.write(b"1234")
        w.close()
        with pytest.raises(EOFError):
            s.read_into("f", 2, memoryview(bytearray(10)))

    def test_abort_removes_the_file(self, tmp_path):
        s = self.make(tmp_path / "ck")
        s.prepare()
        w = s.open_writer("f", 100)
        w.write(b"x" * 50)
        w.abort()
        assert not s.exists("f")
        assert s.list() == []

    def test_commit_publishes_whole_and_leaves_no_temporaries(self, tmp_path):
        s = self.make(tmp_path / "ck")
        assert not s.exists(None)
        s.prepare()
        # a directory exists once prepared; an object-store prefix only once it holds an object
        assert s.exists(None) == s.has_directories and not s.exists("manifest.json")
        s.commit("manifest.json", b"{}")
        s.commit("manifest.json", b'{"v":2}')
        assert s.read("manifest.json") == b'{"v":2}'
        assert s.list() == ["manifest.json"]
        s.delete("manifest.json")
        s.delete("manifest.json")  # deleting twice is fine
        assert s.list() == []

    def test_sizes_are_those_of_the_files_listed(self, tmp_path):
        s = self.make(tmp_path / "ck")
        s.prepare()
        for name, n in (("shard-r00000-0000-a.safetensors", 5000), ("g00001/index-r01024-a.json", 7)):
            w = s.open_writer(name, n)
            w.write(b"x" * n)
            w.close()
        s.commit("manifest.json", b"{}")
        assert s.sizes() == {n: s.size(n) for n in s.list()}
        assert s.sizes() == {
            "g00001/index-r01024-a.json": 7,
            "manifest.json": 2,
            "shard-r00000-0000-a.safetensors": 5000,
        }

    def test_an_exclusive_commit_fails_if_the_name_exists_and_changes_nothing(self, tmp_path):
        s = self.make(tmp_path / "ck")
        s.prepare()
        s.commit("manifest.json", b"first", exclusive=True)
        with pytest.raises(FileExistsError):
            s.commit("manifest.json", b"second", exclusive=True)
        assert s.read("manifest.json") == b"first"
        assert s.list() == ["manifest.json"]  # no temporary left behind

    def test_large_file_in_many_pieces(self, tmp_path):
        """Larger than one part of an object store's multipart upload, written in odd pieces."""
        s = self.make(tmp_path / "ck")
        s.prepare()
        data = os.urandom(12 * 1024 * 1024 + 17)
        buf = _aligned(len(data))
        buf[:] = data
        w = s.open_writer("big", len(data))
        w.write(b"")
        for lo in range(0, len(data), 3 * 1024 * 1024 + 5):
            w.write(buf[lo : lo + 3 * 1024 * 1024 + 5])
        w.close()
        assert s.size("big") == len(data)
        out = _aligned(len(data) - 100)
        s.readv("big", 100, [out[:5], out[5 : 6 * 1024 * 1024], out[6 * 1024 * 1024 :]])
        assert bytes(out) == data[100:]
        assert s.read("big", len(data) - 3) == data[-3:]
        assert s.read("big", len(data) + 10, 5) == b""

    def test_abort_of_a_large_file_half_written_leaves_nothing(self, tmp_path):
        s = self.make(tmp_path / "ck")
        s.prepare()
        w = s.open_writer("big", 12 * 1024 * 1024)
        w.write(os.urandom(7 * 1024 * 1024))
        w.abort()
        assert not s.exists("big")
        assert s.list() == []

    def test_empty_file(self, tmp_path):
        s = self.make(tmp_path / "ck")
        s.prepare()
        w = s.open_writer("empty", 0)
        w.close()
        assert s.size("empty") == 0 and s.read("empty") == b"" and s.list() == ["empty"]

    def test_a_read_with_a_bound_past_the_end_returns_what_the_file_holds(self, tmp_path):
        """How a manifest or an index is read: up to its bound, whatever the file's size now."""
        s = self.make(tmp_path / "ck")
        s.prepare()
        s.commit("small", b"0123456789")
        assert s.read("small", 0, 11) == b"0123456789"
        assert s.read("small", 0, 1 << 30) == b"0123456789"
        assert s.read("small", 4, 100) == b"456789"

    def test_missing_file_raises_file_not_found(self, tmp_path):
        s = self.make(tmp_path / "ck")
        s.prepare()
        with pytest.raises(FileNotFoundError):
            s.read("nope")
        with pytest.raises(FileNotFoundError):
            s.size("nope")
        with pytest.raises(FileNotFoundError):
            s.read_into("nope", 0, memoryview(bytearray(4)))
        assert not s.exists("nope")

    @given(st.lists(st.integers(0, 3 * DIRECT_ALIGN), max_size=6))
    @settings(
        max_examples=40,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.differing_executors],
    )
    def test_any_sequence_of_writes_reads_back(self, tmp_path, sizes):
        s = self.make(tmp_path / f"ck-{uuid.uuid4().hex}")
        s.prepare()
        data = os.urandom(sum(sizes))
        buf = _aligned(len(data))
        buf[:] = data
        w = s.open_writer("f", len(data))
        pos = 0
        for n in sizes:
            w.write(buf[pos : pos + n])
            pos += n
        w.close()
        assert s.read("f") == data

    def test_ranged_vectored_reads_of_a_large_file(self, tmp_path):
        """Any range, split into any buffers, reads back exactly: unaligned starts and ends,
        ranges longer than one direct-I/O bounce buffer (16 MiB), the last byte of the file,
        and buffers of one byte; a range past the end raises EOFError."""
        s = self.make(tmp_path / "ck")
        s.prepare()
        size = 37 * 1024 * 1024 + 4093
        data = os.urandom(1 << 20) * 37 + os.urandom(4093)
        buf = _aligned(size)
        buf[:] = data
        w = s.open_writer("big", size)
        w.write(buf)
        w.close()
        mib = 1 << 20

        @given(st.integers(0, size - 1), st.integers(1, 20 * mib), st.lists(st.integers(1, 9 * mib), max_size=4))
        @settings(max_examples=25, deadline=None)
        def check(offset, length, cuts):
            length = min(length, size - offset)
            sizes = []
            left = length
            for c in cuts:
                if left <= 0:
                    break
                sizes.append(min(c, left))
                left -= sizes[-1]
            if left > 0:
                sizes.append(left)
            outs = [bytearray(n) for n in sizes]
            s.readv("big", offset, [memoryview(o) for o in outs])
            assert b"".join(outs) == data[offset : offset + length]

        check()
        odd = [bytearray(1), bytearray(3 * mib), bytearray(1), bytearray(5000)]
        s.readv("big", size - sum(map(len, odd)), [memoryview(o) for o in odd])
        assert b"".join(odd) == data[-sum(map(len, odd)) :]
        with pytest.raises(EOFError):
            s.read_into("big", size - 2 * mib, memoryview(bytearray(3 * mib)))

    def test_reads_in_a_row_read_what_readv_reads(self, tmp_path):
        """``reading`` (the file kept open between reads, where a backend does that) reads the
        same bytes as ``readv``, buffers of any size in any order of offsets, through the plain
        twin too; past the end it raises EOFError."""
        s = self.make(tmp_path / "ck")
        s.prepare()
        data = os.urandom(5 * (1 << 20) + 777)
        s.commit("f", data)
        for src in (s, s.reads_for("f", 0, len(data)), s.shared_reads()):
            with src.reading("f") as readv:
                for offset, sizes in [(4096, [1, 1 << 20, 4095]), (0, [7]), (len(data) - 9, [4, 5]), (3, [2 << 20])]:
                    outs = [bytearray(n) for n in sizes]
                    readv(offset, [memoryview(o) for o in outs])
                    assert b"".join(outs) == data[offset : offset + sum(sizes)]
                with pytest.raises(EOFError):
                    readv(len(data) - 3, [memoryview(bytearray(4))])

    def test_run_directory_level(self, tmp_path):
        run = self.make(tmp_path / "run")
        assert run.children() == [] and run.list() == []
        a = run.child("step-1")
        a.prepare()
        _write(a, "shard", b"payload")
        a.commit("manifest.json", b"{}")
        nested = a.child("sub")
        nested.prepare()
        _write(nested, "deep", b"d")
        run.child("step-2").prepare()
        _write(run.child("step-2"), "x", b"2")
        _write(run, "top-level-file", b"t")
        assert run.children() == ["step-1", "step-2"]
        assert run.list() == ["top-level-file"]  # files only, never the sub-roots
        assert a.list() == ["manifest.json", "shard"]
        moved = a.move("step-1.damaged")
        assert not run.child("step-1").exists("manifest.json")
        assert moved.read("shard") == b"payload" and moved.read("manifest.json") == b"{}"
        assert moved.child("sub").read("deep") == b"d"
        assert run.children() == ["step-1.damaged", "step-2"]
        moved.remove_tree()
        moved.remove_tree()  # removing twice is fine
        assert run.children() == ["step-2"]
        assert run.child("step-2").read("x") == b"2"

    def test_group_directories_hold_files_of_the_checkpoint(self, tmp_path):
        s = self.make(tmp_path / "ck")
        s.prepare()
        _write(s, "g00001/index-r01024-ab.json", b"idx")
        _write(s, "g00001/shard", b"abc" * 1000)
        _write(s, "root-file", b"r")
        s.sync()
        assert s.list() == ["g00001/index-r01024-ab.json", "g00001/shard", "root-file"]
        assert s.children() == []  # part of the checkpoint, not a sub-root
        assert s.read("g00001/shard", 3, 3) == b"abc" and s.size("g00001/shard") == 3000
        buf = bytearray(4)
        s.read_into("g00001/shard", 1, memoryview(buf))
        assert bytes(buf) == b"bcab"
        assert s.exists("g00001/shard") and not s.exists("g00001/other") and not s.exists("g00002/shard")
        with pytest.raises(FileNotFoundError):
            s.read("g00002/shard")
        w = s.open_writer("g00004/aborted", 10)
        w.write(b"x")
        w.abort()
        s.delete("g00001/shard")
        s.delete("g00001/shard")  # a missing file, or a missing directory, is fine
        s.delete("g00003/x")
        assert [n for n in s.list() if not n.startswith("g00004/")] == ["g00001/index-r01024-ab.json", "root-file"]
        moved = s.move("ck2")
        assert moved.read("g00001/index-r01024-ab.json") == b"idx"
        for bad in ("sub/x", "g1/x", "g00001/sub/x", "../x", "g00001/.."):
            with pytest.raises(ValueError, match="not a file name inside a checkpoint"):  # refused unread
                moved.read(bad)


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _write(s: Storage, name: str, data: bytes) -> None:
    w = s.open_writer(name, len(data))
    w.write(data)
    w.close()


class TestS3Storage(StorageSuite):
    """The same behaviour from S3 objects on a real SeaweedFS server (multipart parts of 5 MiB,
    so the large-file tests upload several parts in parallel and read them back in ranges)."""

    @pytest.fixture(autouse=True)
    def _server(self, s3_env):
        yield

    def make(self, path: Path) -> Storage:
        from conftest import S3_BUCKET
        from stashpoint._storage.s3 import S3Storage
        from stashpoint._storage.s3config import S3Options

        opts = S3Options(part_size=5 * 1024 * 1024, concurrency=4, retry_seconds=10)
        return S3Storage(f"s3://{S3_BUCKET}/suite/{path.parent.name}/{path.name}", opts)


class TestLocalStorage(StorageSuite):
    def make(self, path: Path) -> Storage:
        return LocalStorage(path)

    def test_the_cache_hint_opens_only_regular_files_of_the_checkpoint(self, tmp_path):
        s = LocalStorage(tmp_path / "ck")
        s.prepare()
        (tmp_path / "secret").write_bytes(b"x" * 8192)
        (tmp_path / "secret").read_bytes()  # cached, but outside the checkpoint
        os.symlink(tmp_path / "secret", tmp_path / "ck" / "link")
        os.mkfifo(tmp_path / "ck" / "fifo")  # opening it for reading would block: never opened
        (tmp_path / "ck" / "g00001").mkdir()
        for name in ("link", "fifo", "g00001", "g00001/missing", "g00002/x", "../secret", "", "a\x00b", "/etc/passwd"):
            assert s.cached(name, 0) is False, name
        s.commit("f", b"y" * 8192)
        (tmp_path / "ck" / "f").read_bytes()
        assert s.cached("f", 0) in (True, False) and s.cached("f", -1) is False

    def test_a_group_directory_is_never_reached_through_a_link_or_a_file(self, tmp_path):
        from stashpoint.errors import CorruptCheckpointError

        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "shard-r00001-0000-ab.safetensors").write_bytes(b"secret")
        s = LocalStorage(tmp_path / "ck")
        s.prepare()
        (s.root / "g00000").symlink_to(outside)
        (s.root / "g00001").write_bytes(b"a file")
        for group in ("g00000", "g00001"):
            name = f"{group}/shard-r00001-0000-ab.safetensors"
            for op in (s.read, s.size, s.delete, lambda n: s.open_writer(n, 1)):
                with pytest.raises(CorruptCheckpointError, match=f"{group} is a .*not a directory"):
                    op(name)
        assert (outside / "shard-r00001-0000-ab.safetensors").read_bytes() == b"secret"
        assert s.list() == ["g00001"]  # the link is not followed; the file is a file


def _direct_io_works(path: Path) -> bool:
    probe = path / ".probe"
    probe.write_bytes(b"x" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


def test_large_local_reads_use_direct_io(tmp_path, monkeypatch):
    """Ranges of 1 MiB and more that are not in the page cache are read with O_DIRECT (through a
    bounce buffer) on a file system that allows it; smaller ones, and storages made with
    direct_io=False, read buffered."""
    from stashpoint._storage import local as _storage

    if not _direct_io_works(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")

    calls = []
    real = _storage.readv_direct

    def spy(fd, offset, buffers, pool):
        calls.append((offset, sum(len(b) for b in buffers)))
        return real(fd, offset, buffers, pool)

    monkeypatch.setattr(_storage, "readv_direct", spy)
    data = os.urandom(3 << 20)
    for direct in (True, False):
        s = LocalStorage(tmp_path / f"ck-{direct}", direct_io=direct)
        s.prepare()
        _write(s, "f", data)
        _evict(s.root / "f")  # what the page cache holds is read from it (tests/test_pagecache.py)
        big, small = bytearray(2 << 20), bytearray(1000)
        s.read_into("f", 12345, memoryview(big))
        s.read_into("f", 7, memoryview(small))
        assert bytes(big) == data[12345 : 12345 + (2 << 20)] and bytes(small) == data[7:1007]
    assert calls == [(12345, 2 << 20)]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    size=st.sampled_from([2 << 20, (1 << 20) + 1000, 300_000]),
    offset=st.sampled_from([0, 4096, 8192, 100, 4097]),
    parts=st.lists(st.tuples(st.integers(1, 300_000), st.sampled_from(["pages", "aligned", "unaligned"])), max_size=5),
)
def test_direct_reads_fill_aligned_destinations_in_place(tmp_path, monkeypatch, size, offset, parts):
    """Page-aligned destinations at page-aligned file positions are read into as they are (a
    transfer's stream buffers: no copy through the bounce buffer); any mix with unaligned ones,
    and with aligned ones of a ragged length, reads back the same bytes, up to the file's end."""
    from stashpoint._storage import directio

    if not _direct_io_works(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    path = tmp_path / f"f{size}"
    if not path.exists():
        path.write_bytes(os.urandom(size))
    data = path.read_bytes()
    bounced = []
    real = directio._scatter

    def spy(src, addr, dests):
        bounced.append(len(src))
        real(src, addr, dests)

    # pages: a page-aligned whole number of pages; aligned: page-aligned, any length; else one byte in
    make = {
        "pages": lambda n: _aligned(-(-n // 4096) * 4096),
        "aligned": _aligned,
        "unaligned": lambda n: memoryview(mmap.mmap(-1, n + 1))[1:],
    }
    outs = [make[kind](n) for n, kind in parts]
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        with monkeypatch.context() as m:
            m.setattr(directio, "_scatter", spy)
            filled = directio.readv_direct(fd, offset, outs, directio.BouncePool())
    finally:
        os.close(fd)
    want = data[offset : offset + sum(len(o) for o in outs)]
    assert filled <= len(want) and b"".join(bytes(o) for o in outs)[:filled] == want[:filled]
    if sum(len(o) for o in outs) + offset <= size:
        assert filled == len(want)  # short only at the end of the file (the caller reads the rest)
    if offset % 4096 == 0 and all(kind == "pages" for _, kind in parts) and offset + sum(map(len, outs)) <= size:
        assert bounced == []


def test_a_destination_the_kernel_cannot_read_into_is_bounced(tmp_path, monkeypatch):
    """An in-place read refused with EFAULT (memory direct I/O cannot target) is done through
    the bounce buffer instead."""
    import errno

    from stashpoint._storage import directio

    if not _direct_io_works(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    data = os.urandom(1 << 20)
    (tmp_path / "f").write_bytes(data)
    real = os.preadv
    refused = []

    def preadv(fd, bufs, pos):
        if len(bufs) == 1 and len(bufs[0]) == len(out):  # the in-place read of the whole destination
            refused.append(pos)
            raise OSError(errno.EFAULT, "Bad address")
        return real(fd, bufs, pos)

    out = _aligned(1 << 20)
    monkeypatch.setattr(directio.os, "preadv", preadv)
    fd = os.open(tmp_path / "f", os.O_RDONLY | os.O_DIRECT)
    try:
        assert directio.readv_direct(fd, 0, [out], directio.BouncePool(nbytes=256 << 10)) == len(data)
    finally:
        os.close(fd)
    assert refused == [0] and bytes(out) == data


def test_a_short_or_refused_direct_read_is_finished_buffered(tmp_path, monkeypatch):
    """A direct read that comes back short (some network file systems do) is finished with
    buffered reads; one refused part-way (EINVAL) is read again whole, buffered, and direct reads
    stay off for that storage. Only a real end of file is an EOFError."""
    import errno

    from stashpoint._storage import local as _storage

    real = _storage.readv_direct
    mode = {"v": "short"}

    def flaky(fd, offset, buffers, pool):
        half = [memoryview(b)[: len(b) // 2] for b in buffers[:1]]  # real direct read of a part
        got = real(fd, offset, half, pool)
        if mode["v"] == "refuse":
            raise OSError(errno.EINVAL, "Invalid argument")
        return got

    monkeypatch.setattr(_storage, "readv_direct", flaky)
    data = os.urandom((5 << 20) + 77)
    s = LocalStorage(tmp_path / "ck")
    s.prepare()
    _write(s, "f", data)
    _evict(s.root / "f")
    outs = [bytearray(3 << 20), bytearray(2 << 20)]
    s.readv("f", 70, [memoryview(o) for o in outs])
    assert b"".join(outs) == data[70 : 70 + (5 << 20)]
    with pytest.raises(EOFError, match="ended at byte"):
        s.read_into("f", 1 << 20, memoryview(bytearray(5 << 20)))
    mode["v"] = "refuse"
    _evict(s.root / "f")  # the reads above cached it
    outs = [bytearray(3 << 20), bytearray(1 << 20)]
    s.readv("f", 4096, [memoryview(o) for o in outs])
    assert b"".join(outs) == data[4096 : 4096 + (4 << 20)]
    assert not s._direct_reads, "direct reads are off once refused"


def test_shared_reads_go_through_the_page_cache(tmp_path):
    s = LocalStorage(tmp_path / "ck")
    shared = s.shared_reads()
    assert isinstance(shared, LocalStorage) and shared.root == s.root and not shared._direct_reads
    assert LocalStorage(tmp_path, direct_io=False).shared_reads()._direct_reads is False


class TestLocalStorageBuffered(StorageSuite):
    def make(self, path: Path) -> Storage:
        return LocalStorage(path, direct_io=False)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no tmpfs at /dev/shm on this machine")
class TestLocalStorageOnTmpfs(StorageSuite):
    """tmpfs refuses O_DIRECT: the writer must fall back to buffered writes."""

    @pytest.fixture(autouse=True)
    def _shm(self):
        import shutil
        import tempfile

        self.shm = Path(tempfile.mkdtemp(dir="/dev/shm"))
        yield
        shutil.rmtree(self.shm)

    def make(self, path: Path) -> Storage:
        return LocalStorage(self.shm / path.parent.name / path.name)


def test_storage_for_paths():
    assert isinstance(storage_for("x"), LocalStorage)
    s = LocalStorage("y")
    assert storage_for(s) is s
    s3 = storage_for("s3://my-bucket/runs//exp1/")
    assert type(s3).__name__ == "S3Storage" and s3.location == "s3://my-bucket/runs/exp1"
    assert storage_for(s3.location) == s3, "a storage's location gives the same storage back"
    with pytest.raises(ValueError, match="unsupported storage scheme 'gs'"):
        storage_for("gs://bucket/x")
    with pytest.raises(TypeError, match="path must be"):
        storage_for(3)  # type: ignore[arg-type]


def test_local_knobs_come_from_the_environment(monkeypatch):
    s = storage_for("x")
    assert isinstance(s, LocalStorage) and s.direct_io and s.write_streams == 2
    monkeypatch.setenv("STASHPOINT_WRITE_STREAMS", "4")
    monkeypatch.setenv("STASHPOINT_DIRECT_IO", "0")
    s = storage_for("x")
    assert isinstance(s, LocalStorage) and not s.direct_io and s.write_streams == 4
    assert s.child("step-00000001").write_streams == 4  # a manager's steps inherit them
    monkeypatch.setenv("STASHPOINT_WRITE_STREAMS", "many")
    with pytest.raises(ValueError, match="STASHPOINT_WRITE_STREAMS='many' is not a number"):
        storage_for("x")
    monkeypatch.setenv("STASHPOINT_WRITE_STREAMS", "0")
    with pytest.raises(ValueError, match="STASHPOINT_WRITE_STREAMS='0' is out of range"):
        storage_for("x")


def test_as_memoryview_is_zero_copy():
    import torch

    t = torch.zeros(4, dtype=torch.float32)
    mv = as_memoryview(t)
    mv[0:4] = b"\x00\x00\x80\x3f"
    assert t[0].item() == 1.0


def test_directories_a_save_creates_are_synced_into_their_parents(tmp_path, monkeypatch):
    """A new checkpoint directory's name lives in its parent: without syncing the parent a power
    loss can lose the whole (fsynced) checkpoint. Recorded here: a power loss cannot be."""
    from stashpoint._storage import localwrite

    synced: list[Path] = []
    real = localwrite.fsync_dir
    monkeypatch.setattr(localwrite, "fsync_dir", lambda p: (synced.append(Path(p)), real(p)))
    (tmp_path / "runs").mkdir()
    LocalStorage(tmp_path / "runs" / "run" / "step-1").prepare()
    assert set(synced) == {tmp_path / "runs", tmp_path / "runs" / "run"}
    synced.clear()
    LocalStorage(tmp_path / "runs" / "run" / "step-1").prepare()
    assert synced == [], "nothing new: nothing to sync"


def test_a_parent_this_process_may_not_read_is_not_synced_and_the_save_goes_on(tmp_path, monkeypatch):
    """A drop box (mode 0733): a directory can be made in it, not opened to sync it."""
    import errno

    from stashpoint._storage import localwrite

    def refused(path):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(localwrite, "fsync_dir", refused)
    LocalStorage(tmp_path / "box" / "ck").prepare()
    assert (tmp_path / "box" / "ck").is_dir()
