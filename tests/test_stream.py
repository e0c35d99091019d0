"""A transfer's stream: its buffers are page-aligned, come back to the process's pool when the
stream is done (also after a failure) and serve the next transfer; received files land without
space reserved per file (the transfer checked the room for all of them first)."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from pathlib import Path

import pytest

from stashpoint import _runtime
from stashpoint._core.nodeplan import Transfer
from stashpoint._dist import stream as stream_mod
from stashpoint._dist.arrival import CollectiveError
from stashpoint._dist.group import DistContext
from stashpoint._dist.landing import Landing, land
from stashpoint._dist.stream import CHUNK, Stream
from stashpoint._storage import LocalStorage, directio
from stashpoint._storage.localwrite import LocalWriter
from stashpoint.errors import CheckpointError


@pytest.fixture(autouse=True)
def _fresh_pool():
    _runtime.drop("dist.stream-buffers")
    yield
    _runtime.drop("dist.stream-buffers")


def _addresses(s: Stream) -> list[int]:
    return [ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in s._maps]


def test_buffers_are_page_aligned_and_serve_the_next_transfer(tmp_path: Path):
    first = Stream(DistContext.solo(), 0)
    used = _addresses(first)
    assert all(a % 4096 == 0 for a in used) and all(len(m) == CHUNK for m in first._maps)
    first.done()
    second = Stream(DistContext.solo(), 0)
    assert sorted(_addresses(second)) == sorted(used)  # the same mappings: nothing faulted in again
    second.done()


def test_buffers_made_ahead_on_a_thread_serve_the_first_transfer(monkeypatch):
    """A node-local manager's leader makes its transfer buffers while the restore lists and
    plans: the first stream takes them, none made on its caller's thread."""
    stream_mod.warm(2).join()
    ahead = sorted(ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in stream_mod._pool()._idle)
    assert len(ahead) == 2
    made = []
    original = stream_mod.BouncePool.take

    def take(self):
        made.append(not self._idle)
        return original(self)

    monkeypatch.setattr(stream_mod.BouncePool, "take", take)
    s = Stream(DistContext.solo(), 0)
    assert made == [False, False] and sorted(_addresses(s)) == ahead
    s.done()


def test_a_transfer_started_while_its_buffers_are_made_ahead_waits_for_them(monkeypatch):
    """A restore's first transfer can start before the buffers made ahead are ready: it waits
    for them, and makes none of its own (two populated at once wait for the kernel's
    compaction in turn). Where none are being made, or making them failed, it makes its own."""
    made: list[str] = []
    real = directio.huge_mapping

    def slow(nbytes, populate=True):
        made.append(threading.current_thread().name)
        time.sleep(0.2)  # a kernel compacting memory
        return real(nbytes, populate)

    monkeypatch.setattr(directio, "huge_mapping", slow)
    pool = directio.BouncePool(1 << 20, keep=4)
    pool.prepare(2)
    assert pool.take() is not None and pool.take() is not None
    assert made == ["stashpoint-buffers"] * 2, made
    pool.take()
    assert made[-1] == threading.current_thread().name, "none being made: made here"

    def fail(nbytes, populate=True):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(directio, "huge_mapping", fail)
    pool = directio.BouncePool(1 << 20, keep=4)
    pool.prepare(2).join()
    monkeypatch.setattr(directio, "huge_mapping", real)
    assert pool.take() is not None, "a failed preparation leaves no take waiting"


def test_a_take_waiting_for_buffers_made_ahead_is_released_when_making_them_fails_or_stalls(monkeypatch):
    real = directio.huge_mapping
    go = threading.Event()

    def stuck(nbytes, populate=True):
        if threading.current_thread().name == "stashpoint-buffers":
            go.wait(10)
            raise OSError(12, "Cannot allocate memory")
        return real(nbytes, populate)

    monkeypatch.setattr(directio, "huge_mapping", stuck)
    pool = directio.BouncePool(1 << 20, keep=4)
    pool.prepare(2)
    threading.Timer(0.3, go.set).start()  # the maker fails while the take below waits for it
    t0 = time.monotonic()
    assert pool.take() is not None
    assert 0.2 < time.monotonic() - t0 < 5, "released by the failure, not by the bound"

    go.clear()
    monkeypatch.setattr(directio, "_MAKING_WAIT_S", 0.3)
    pool = directio.BouncePool(1 << 20, keep=4)
    pool.prepare(1)  # stalls until go is set
    t0 = time.monotonic()
    assert pool.take() is not None
    assert time.monotonic() - t0 < 2, "a stalled maker is waited for no longer than the bound"
    go.set()


def test_buffers_made_ahead_never_exceed_what_the_pool_keeps_idle():
    pool = directio.BouncePool(1 << 20, keep=3)
    pool.prepare(2).join()
    pool.prepare(5).join()
    assert len(pool._idle) == 3
    with pytest.raises(ValueError, match="count"):
        pool.prepare(-1)


def test_a_remote_tiers_stream_reads_larger_pieces_and_lands_them(tmp_path: Path):
    """Reads from a remote tier (here a local directory standing in as the source) go in
    pieces of several ranged GETs, through buffers of their own that the pool does not keep."""
    src = LocalStorage(tmp_path / "src")
    src.prepare()
    data = os.urandom(stream_mod._REMOTE_CHUNK + 12345)  # two pieces: both buffers are used
    (tmp_path / "src" / "a.bin").write_bytes(data)
    s = Stream(None, -1, source=src)
    assert all(len(m) == stream_mod._REMOTE_CHUNK for m in s._maps)
    land(LocalStorage(tmp_path / "dst"), Transfer(0, 1), [("a.bin", len(data))], s, False)
    assert (tmp_path / "dst" / "a.bin").read_bytes() == data
    assert stream_mod._pool()._idle == []


def test_a_failed_stream_still_gives_its_buffers_back(tmp_path: Path):
    src = LocalStorage(tmp_path / "src")
    src.prepare()
    s = Stream(DistContext.solo(), 0)
    used = _addresses(s)
    s._read(src, "missing.bin", [(0, 100)], s.mvs[0][:100])  # what send() does first
    assert bytes(s.mvs[0][:100]) == bytes(100)  # zeros in its place, the error kept for done()
    with pytest.raises(CheckpointError, match=r"missing\.bin"):
        s.done()
    assert sorted(_addresses(Stream(DistContext.solo(), 0))) == sorted(used)


def test_the_pool_keeps_at_most_four_idle_buffers():
    pool = stream_mod._pool()
    maps = [pool.take() for _ in range(6)]
    for m in maps:
        pool.give(m)
    again = [pool.take() for _ in range(6)]
    assert sum(any(m is k for k in maps) for m in again) == stream_mod._KEEP


def test_landing_reserves_no_space_per_file_where_saves_do(tmp_path: Path):
    size = 8 << 20
    reserved = LocalWriter(tmp_path / "saved", size)
    landed = Landing(tmp_path, durable=False).open_writer("landed", size)
    try:
        if os.stat(tmp_path / "saved").st_blocks == 0:
            pytest.skip("this file system reserves no space with posix_fallocate")
        assert os.stat(tmp_path / "landed").st_blocks == 0
    finally:
        reserved.abort()
        landed.abort()


def test_a_stream_that_raised_keeps_its_buffers(tmp_path: Path, monkeypatch):
    """A send that failed part-way (a peer gone) never reaches done(): its buffers, which a
    read-ahead may still be filling, are not handed to the next transfer."""
    src = LocalStorage(tmp_path / "src")
    src.prepare()
    (tmp_path / "src" / "a.bin").write_bytes(os.urandom(CHUNK + 1))

    def gone(*_args, **_kw):
        raise CollectiveError("rank 1: sending with rank 0 failed: peer gone")

    monkeypatch.setattr(stream_mod, "send_tensor", gone)
    s = Stream(DistContext.solo(), 0)
    used = _addresses(s)
    with pytest.raises(CollectiveError):
        s.send(src, "a.bin", [(0, CHUNK + 1)])
    fresh = Stream(DistContext.solo(), 0)
    assert not set(_addresses(fresh)) & set(used)
    fresh.done()


def _smaps_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``address`` (the kernel may merge
    neighbouring mappings of the same kind into one)."""
    fields: dict[str, str] = {}
    found = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            if found:
                break
            lo, hi = (int(x, 16) for x in head.split("-"))
            found = lo <= address < hi
        elif found:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@pytest.mark.skipif(
    not (
        hasattr(mmap, "MADV_HUGEPAGE")
        and Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()
        and Path("/proc/self/smaps").exists()
    ),
    reason="needs Linux with transparent huge pages and /proc/self/smaps",
)
def test_transfer_and_bounce_buffers_ask_for_huge_pages_and_come_populated():
    """Direct I/O pins a buffer's pages per request: the buffers kept for it ask for huge
    pages (VmFlags ``hg``) and are faulted in when made, not by the first read."""
    from stashpoint._storage.directio import huge_mapping

    m = huge_mapping(16 << 20)
    fields = _smaps_of(ctypes.addressof(ctypes.c_char.from_buffer(m)))
    if "VmFlags" not in fields:
        pytest.skip("this /proc/self/smaps shows no VmFlags")
    assert "hg" in fields["VmFlags"].split()
    assert int(fields["Rss"].split()[0]) == int(fields["Size"].split()[0])  # every page resident
    s = Stream(DistContext.solo(), 0)
    assert all("hg" in _smaps_of(a)["VmFlags"].split() for a in _addresses(s))
    s.done()
