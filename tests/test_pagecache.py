"""The newest checkpoint kept in the page cache for a same-node restart (issue 21, part 6).

Residency is measured independently of the library, with mincore(2) on a mapping of each file.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import stashpoint
from dist_util import run_world
from stashpoint._storage import LocalStorage, pagecache
from stashpoint._storage import local as _local

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise (Linux)")

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_PAGE = mmap.PAGESIZE


def resident(path: Path) -> float:
    """The fraction of ``path``'s pages in the page cache (a private mapping, never touched)."""
    size = path.stat().st_size
    if size == 0:
        return 1.0
    pages = -(-size // _PAGE)
    vec = (ctypes.c_ubyte * pages)()
    with path.open("rb") as f:
        m = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        ref = ctypes.c_char.from_buffer(m)
        rc = _libc.mincore(ctypes.c_void_p(ctypes.addressof(ref)), ctypes.c_size_t(size), vec)
        del ref
        if rc != 0:
            raise OSError(ctypes.get_errno(), "mincore")
    finally:
        m.close()
    return sum(v & 1 for v in vec) / pages


def shards(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*.safetensors"))


def wait_resident(files: list[Path], want: float, timeout: float = 20.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        got = min(resident(f) for f in files)
        if got >= want or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def evict(fd: int) -> None:
    """Drop the open file's pages from the page cache (written back first: only clean pages go)."""
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def direct_io_works(tmp: Path) -> bool:
    """Whether ``tmp`` is on a disk with a page cache: direct I/O opens, and a written page can
    be evicted (tmpfs takes O_DIRECT since Linux 6.6, but its pages are the file)."""
    probe = tmp / ".probe"
    probe.write_bytes(b"\1" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        fd = os.open(probe, os.O_RDONLY)
        try:
            evict(fd)
        finally:
            os.close(fd)
        return resident(probe) == 0.0
    except OSError:
        return False
    finally:
        probe.unlink()


@pytest.fixture
def state():
    g = torch.Generator().manual_seed(0)
    # larger than a read-ahead window (WILLNEED reads at most one per call)
    return {"w": torch.randn(6 << 20, generator=g), "b": torch.randn(3 << 18, generator=g)}


def test_the_newest_save_is_read_back_into_the_cache_and_the_previous_one_let_go(tmp_path, state):
    if not direct_io_works(tmp_path):
        pytest.skip(f"{tmp_path} is not on a disk with a page cache (everything is cached there anyway)")
    stashpoint.save(state, LocalStorage(tmp_path / "step-1"))
    first = shards(tmp_path / "step-1")
    # the kernel's read-back is best effort: it may leave a few pages out (0.2% seen under a
    # loaded CI run), which a load reads through (test_a_load_reads_small_gaps_... below)
    assert wait_resident(first, 0.99) >= 0.99, "the committed shards are read back into the page cache"
    stashpoint.save(state, LocalStorage(tmp_path / "step-2"))
    assert wait_resident(shards(tmp_path / "step-2"), 0.99) >= 0.99
    deadline = time.monotonic() + 20
    while max(resident(f) for f in first) > 0.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert max(resident(f) for f in first) == 0.0, "the previous step's pages are let go"


def test_a_nodes_replicas_stay_cached_beside_its_own_files_and_go_with_them(tmp_path, state, monkeypatch):
    """A node's leader keeps its own files of the newest step and the replicas it holds of other
    nodes' (one process, one checkpoint: the second ask adds to the first), within the node's
    share of memory beside its own files (``beside``) where one rank's share is too small; the
    next step's files let both go."""
    if not direct_io_works(tmp_path):
        pytest.skip(f"{tmp_path} is not on a disk with a page cache")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    big = LocalStorage(tmp_path / "step-1")
    stashpoint.save(state, big)  # its own files: kept (keep_cached after the commit)
    own = shards(tmp_path / "step-1")
    assert wait_resident(own, 0.99) >= 0.99
    theirs = tmp_path / "step-1" / "shard-r00001-copy.safetensors"
    with theirs.open("wb") as f:  # a replica, landed directly: not cached
        f.write(os.urandom(12 << 20))
        evict(f.fileno())
    monkeypatch.setattr(pagecache, "mem_available", lambda: 64 << 20)  # one rank of 8: 4 MiB, the node: 32
    assert not pagecache.keep_cached(big.root, [theirs]), "more than one rank's share"
    assert not pagecache.keep_cached(big.root, [theirs], beside=24 << 20), "more than the node's own files leave"
    assert pagecache.keep_cached(big.root, [theirs], beside=16 << 20)
    assert wait_resident([theirs], 0.99) >= 0.99
    assert min(resident(f) for f in own) >= 0.99, "the own files stay kept"
    monkeypatch.undo()
    stashpoint.save(state, LocalStorage(tmp_path / "step-2"))
    deadline = time.monotonic() + 20
    while max(resident(f) for f in [*own, theirs]) > 0.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert max(resident(f) for f in [*own, theirs]) == 0.0, "the older step's files and replicas are let go"


def test_the_replicas_a_node_keeps_of_other_nodes_files_are_read_back_into_its_cache(tmp_path):
    """Two ranks, each a node with its own directory, replicas=1: the copy each node keeps of
    the other's shard (landed with direct I/O) is in its page cache once the save returned, as
    its own files are, so a replacement for the other node is served from memory."""
    if not direct_io_works(tmp_path):
        pytest.skip(f"{tmp_path} is not on a disk with a page cache")
    for r in run_world(2, "replica_cached", str(tmp_path)):
        assert r["files"] == 1 and r["size"] >= 16 << 20, r
        assert r["cached"] >= 0.99, r


def test_without_cache_newest_direct_writes_leave_nothing_cached(tmp_path, state):
    if not direct_io_works(tmp_path):
        pytest.skip(f"{tmp_path} is not on a disk with a page cache")
    stashpoint.save(state, LocalStorage(tmp_path / "ck", cache_newest=False))
    time.sleep(1.0)
    assert max(resident(f) for f in shards(tmp_path / "ck")) < 0.05


def test_a_save_larger_than_its_share_of_memory_is_not_cached(tmp_path, state, monkeypatch):
    if not direct_io_works(tmp_path):
        pytest.skip(f"{tmp_path} is not on a disk with a page cache")
    monkeypatch.setattr(pagecache, "mem_available", lambda: 16 << 20)  # an 8 MiB share < the ~27 MiB save
    stashpoint.save(state, LocalStorage(tmp_path / "ck"))
    time.sleep(1.0)
    assert max(resident(f) for f in shards(tmp_path / "ck")) < 0.05


def direct_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the direct reads made from now on (the test skipped where there are none)."""
    if not direct_io_works(tmp_path):
        pytest.skip(f"{tmp_path} is not on a disk with a page cache")
    calls: list[int] = []
    real = _local.readv_direct

    def spy(fd, offset, buffers, pool):
        calls.append(sum(len(b) for b in buffers))
        return real(fd, offset, buffers, pool)

    monkeypatch.setattr(_local, "readv_direct", spy)
    return calls


def test_a_load_takes_cached_bytes_without_direct_reads_and_the_rest_directly(tmp_path, state, monkeypatch, asking):
    calls = direct_reads(tmp_path, monkeypatch)
    stashpoint.save(state, LocalStorage(tmp_path / "cached"))
    # the save's read-back is the kernel's best effort (the test above checks it; under a
    # loaded CI run it left 0.2% out): this test is about the load, so fill any gap first
    for f in shards(tmp_path / "cached"):
        f.read_bytes()
    assert wait_resident(shards(tmp_path / "cached"), 1.0) == 1.0
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    stashpoint.load(out, LocalStorage(tmp_path / "cached"))
    assert all(torch.equal(out[k], state[k]) for k in state)
    assert calls == [], "everything was resident: no direct read"

    stashpoint.save(state, LocalStorage(tmp_path / "cold", cache_newest=False))
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    stashpoint.load(out, LocalStorage(tmp_path / "cold"))
    assert all(torch.equal(out[k], state[k]) for k in state)
    assert sum(calls) > 16 << 20, "nothing was cached: the bytes came from direct reads"


def test_read_resident_fills_only_what_is_cached(tmp_path, asking):
    data = os.urandom(3 << 20)
    with evicted_file(tmp_path / "f", data) as fd:
        os.pread(fd, 1 << 20, 0)  # the first MiB (and some read-ahead) cached again
        bufs = [memoryview(bytearray(1 << 20)), memoryview(bytearray(2 << 20))]
        n = pagecache.read_resident(fd, 0, bufs)
        assert (1 << 20) <= n <= (3 << 20)
        assert bytes(b"".join(bytes(b) for b in bufs))[:n] == data[:n]


def punch_gaps(path: Path, every: int = 2 << 20, gap: int = 64 << 10) -> None:
    """Evict ``gap`` bytes of ``path``'s cached pages every ``every`` bytes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for off in range(every // 2, path.stat().st_size - gap, every):
            os.posix_fadvise(fd, off, gap, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_a_load_reads_small_gaps_in_cached_files_without_direct_reads(tmp_path, state, monkeypatch, asking):
    """A few pages left out of the cache (the read-back's best effort) are read on their own:
    they do not send the rest of a 64 MiB read to the disk."""
    calls = direct_reads(tmp_path, monkeypatch)
    stashpoint.save(state, LocalStorage(tmp_path / "ck", cache_newest=False))
    files = shards(tmp_path / "ck")
    for f in files:
        f.read_bytes()
        punch_gaps(f)
    assert 0.9 < min(resident(f) for f in files) < 1.0, "gaps in cached files"
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    stashpoint.load(out, LocalStorage(tmp_path / "ck"))
    assert all(torch.equal(out[k], state[k]) for k in state)
    assert calls == [], "only the gaps were read from the disk, with ordinary reads"


@contextlib.contextmanager
def evicted_file(path: Path, data: bytes) -> Iterator[int]:
    """A read descriptor of ``path``, written with ``data``, none of its pages cached (the test
    skipped on a file system that keeps them, such as tmpfs)."""
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        evict(fd)
        if resident(path) > 0.0:
            pytest.skip(f"{path.parent} keeps its pages (tmpfs?): nothing can be evicted")
        yield fd
    finally:
        os.close(fd)


@pytest.fixture(params=["cachestat", "mincore"])
def asking(request, monkeypatch):
    """Residency asked by cachestat (Linux 6.5+), and by mincore alone as on older kernels."""
    if request.param == "mincore":
        monkeypatch.setattr(pagecache, "_cachestat_missing", True)
    elif not _cachestat_answers():
        pytest.skip("this kernel has no cachestat (Linux 6.5+)")
    return request.param


def _cachestat_answers() -> bool:
    with open(__file__, "rb") as f:
        return pagecache._all_cached(f.fileno(), 0, 1) is not None


def test_cachestat_and_mincore_give_the_same_answers(tmp_path, monkeypatch):
    if not _cachestat_answers():
        pytest.skip("this kernel has no cachestat (Linux 6.5+)")
    data = os.urandom(8 << 20)
    with evicted_file(tmp_path / "f", data) as fd:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.pread(fd, 3 << 20, 1 << 20)
        os.posix_fadvise(fd, 2 << 20, 4096, os.POSIX_FADV_DONTNEED)
        size = len(data)
        for off, n in [(0, 4096), (1 << 20, 1 << 20), (1 << 20, 3 << 20), ((2 << 20) + 4096, 1 << 20), (5000, 100)]:
            by_cachestat = pagecache._all_cached(fd, off, n)
            monkeypatch.setattr(pagecache, "_cachestat_missing", True)
            run = pagecache._page_run(fd, off, n, size, probe=n)
            monkeypatch.setattr(pagecache, "_cachestat_missing", False)
            assert by_cachestat == (run is not None and run[0] and run[1] == n), (off, n)


def test_a_storage_tells_whether_the_page_cache_holds_a_position(tmp_path, asking):
    data = os.urandom(16 << 20)
    with evicted_file(tmp_path / "f", data) as fd:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead past what is read
        storage = LocalStorage(tmp_path)
        assert not storage.cached("f", 0) and not storage.cached("f", 12 << 20)
        os.pread(fd, 1 << 20, 0)
        assert storage.cached("f", 0) and storage.cached("f", (1 << 20) - 1)
        assert not storage.cached("f", 12 << 20)
        plain = storage.reads_for("f", 0, 1 << 20)
        assert plain is not storage and not plain._direct_reads, "every byte cached: read without direct I/O"
        assert storage.reads_for("f", 4096, (1 << 20) - 4096) is plain, "one twin, made once"
        assert storage.reads_for("f", 0, 2 << 20) is storage, "a range cached in part"
        os.pread(fd, 16 << 20, 0)
        assert storage.reads_for("f", 0, 16 << 20) is plain
        os.posix_fadvise(fd, 8 << 20, 8 << 20, os.POSIX_FADV_DONTNEED)  # the second half out
        assert storage.reads_for("f", 0, 16 << 20) is storage and storage.reads_for("f", 0, 8 << 20) is plain
        os.pread(fd, 8 << 20, 8 << 20)
        os.posix_fadvise(fd, (16 << 20) - 4096, 4096, os.POSIX_FADV_DONTNEED)  # the last page out
        assert storage.reads_for("f", 0, 16 << 20) is storage, "the last page is always asked about"
        assert storage.reads_for("f", (8 << 20) + 4096, 8 << 20) is storage, "past the end of the file"
    assert not storage.cached("missing", 0) and storage.reads_for("missing", 0, 4096) is storage  # never an error


def test_a_range_running_past_the_end_of_a_file_is_not_wholly_cached(tmp_path, asking):
    f = tmp_path / "f"
    f.write_bytes(os.urandom(10000))  # not a whole number of pages
    fd = os.open(f, os.O_RDONLY)
    try:
        os.pread(fd, 10000, 0)
        assert pagecache.resident_sampled(fd, 0, 10000) and pagecache.resident_sampled(fd, 100, 9900)
        assert not pagecache.resident_sampled(fd, 0, 11000), "it ends within the last page"
        assert not pagecache.resident_sampled(fd, 0, 0)
    finally:
        os.close(fd)


class _Tagged(LocalStorage):
    """A storage subclass of a user's own, with its own constructor and state."""

    def __init__(self, root: Path, tag: list[str]) -> None:
        super().__init__(root)
        self.tag = tag

    def readv(self, name, offset, buffers):
        self.tag.append(name)
        super().readv(name, offset, buffers)


def test_a_subclass_of_local_storage_loads_a_cached_checkpoint_through_its_own_reads(tmp_path, state):
    """The cached path reads through a copy of the storage without direct reads: a subclass
    with a constructor of its own still loads, and its own reads still run."""
    stashpoint.save(state, LocalStorage(tmp_path / "ck"))
    for f in shards(tmp_path / "ck"):
        f.read_bytes()
    seen: list[str] = []
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    stashpoint.load(out, _Tagged(tmp_path / "ck", seen))
    assert all(torch.equal(out[k], state[k]) for k in state)
    assert any(n.endswith(".safetensors") for n in seen), seen
    twin = _Tagged(tmp_path / "ck", seen).shared_reads()
    assert isinstance(twin, _Tagged) and twin.tag is seen


def test_a_read_job_the_cache_holds_whole_reads_plainly_without_probing_each_read(tmp_path, state, monkeypatch):
    """Where the page cache holds a read job (as a sample of its pages shows), it is read with
    plain reads: no residency probe before each of its 4 MiB reads (they cost a cached load a
    tenth of its time), and a few pages left out come through the cache. A job cached in part
    still goes read by read, the cached part from the cache and the rest directly."""
    calls = direct_reads(tmp_path, monkeypatch)
    probes: list[int] = []
    real = _local.read_resident

    def spy(fd, offset, buffers):
        probes.append(offset)
        return real(fd, offset, buffers)

    monkeypatch.setattr(_local, "read_resident", spy)
    stashpoint.save(state, LocalStorage(tmp_path / "ck", cache_newest=False))
    files = shards(tmp_path / "ck")
    for f in files:
        f.read_bytes()
    assert wait_resident(files, 1.0) == 1.0
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    stashpoint.load(out, LocalStorage(tmp_path / "ck"))
    assert all(torch.equal(out[k], state[k]) for k in state)
    assert probes == [] and calls == [], "cached whole: plain reads"

    punch_gaps(files[0])
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    stashpoint.load(out, LocalStorage(tmp_path / "ck"))
    assert all(torch.equal(out[k], state[k]) for k in state)
    assert probes == [] and calls == [], "scattered gaps: plain reads still, the gaps through the cache"

    size = files[0].stat().st_size
    fd = os.open(files[0], os.O_RDONLY)
    os.posix_fadvise(fd, size // 2, 0, os.POSIX_FADV_DONTNEED)  # its second half
    os.close(fd)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    stashpoint.load(out, LocalStorage(tmp_path / "ck"))
    assert all(torch.equal(out[k], state[k]) for k in state)
    assert probes and calls, "in part: probed read by read, the cached part from the cache, the rest directly"


def test_read_resident_reads_through_a_gap_and_stops_where_the_disk_part_begins(tmp_path, asking):
    data = os.urandom(12 << 20)
    f = tmp_path / "f"
    with evicted_file(f, data) as fd:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead past what is read
        os.pread(fd, 6 << 20, 0)  # the first 6 MiB cached
        os.posix_fadvise(fd, 2 << 20, 8 << 10, os.POSIX_FADV_DONTNEED)  # a gap of two pages
        assert resident(f) == pytest.approx(0.5, abs=0.01)
        buf = memoryview(bytearray(12 << 20))
        n = pagecache.read_resident(fd, 0, [buf])
        assert n == 6 << 20, "through the gap, up to the 6 MiB that are not cached"
        assert bytes(buf[:n]) == data[:n]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to become another user")
def test_read_resident_does_not_trust_mincore_for_a_file_the_process_may_not_write(tmp_path, asking):
    """mincore says every page is cached when the caller neither owns the file nor may write
    it: there the non-blocking reads decide, and a cold file is left to the direct reads."""
    with evicted_file(tmp_path / "f", os.urandom(8 << 20)) as fd:
        pid = os.fork()
        if pid == 0:  # as nobody, on the descriptor root opened
            code = 3
            try:
                os.setgid(65534)
                os.setuid(65534)
                n = pagecache.read_resident(fd, 0, [memoryview(bytearray(8 << 20))])
                code = 0 if n < (1 << 20) else 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "a cold file read buffered: mincore was trusted"


def test_a_cachestat_no_is_asked_again_of_mincore(tmp_path, monkeypatch):
    """On overlayfs cachestat counts the overlay's own (empty) cache and says no for a cached
    file, where a mapping reaches the real file: a no is confirmed with mincore, a yes taken."""
    f = tmp_path / "f"
    f.write_bytes(os.urandom(1 << 20))
    fd = os.open(f, os.O_RDONLY)
    try:
        os.pread(fd, 1 << 20, 0)
        monkeypatch.setattr(pagecache, "_all_cached", lambda fd, offset, length: False)
        assert pagecache.resident_at(fd, 4096) and pagecache.resident_sampled(fd, 0, 1 << 20)
    finally:
        os.close(fd)


def test_checkpoints_each_in_a_directory_of_its_own_are_kept_a_few_at_a_time(tmp_path):
    """Before: one entry per parent directory for the life of the process (300 saves to
    run{i}/ckpt: 300 entries), and none of their files ever let go."""
    kept = pagecache._kept()
    kept.files.clear()
    for i in range(12):
        ckpt = tmp_path / f"run{i}" / "ckpt"
        ckpt.mkdir(parents=True)
        (ckpt / "shard").write_bytes(b"x" * 4096)
        assert pagecache.keep_cached(ckpt, [ckpt / "shard"])
    assert list(kept.files) == [tmp_path / f"run{i}" for i in range(4, 12)]
