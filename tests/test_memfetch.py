"""What a node-local restore fetches lands in memory the node's processes share, is read from
there through a view over the node's directory, and is copied into that directory after the
load (issue 21: the disk tier's read-back). The restores themselves run in test_nodelocal.py."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest

from stashpoint._core.naming import MANIFEST_NAME, index_name, shard_name
from stashpoint._dist import memfetch
from stashpoint._dist.landing import partial_name
from stashpoint._manager.holdings import inventory
from stashpoint._storage import LocalStorage
from stashpoint._storage.overlay import Overlay
from stashpoint.errors import CheckpointError

SHM = Path("/dev/shm")
needs_shm = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this host")


@pytest.fixture
def shm(monkeypatch):
    """A fresh directory on /dev/shm, made the memory area's base."""
    base = Path(tempfile.mkdtemp(prefix="stashpoint-test-", dir=SHM))
    monkeypatch.setenv(memfetch.ENV, str(base))
    yield base
    shutil.rmtree(base, ignore_errors=True)


@needs_shm
def test_each_node_directory_has_an_area_of_its_own_and_a_memory_tier_none(shm, tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = memfetch.area(tmp_path / "a"), memfetch.area(tmp_path / "b")
    assert a is not None and b is not None and a != b
    assert a.parent == shm / f"stashpoint-{os.getuid()}"
    assert memfetch.area(tmp_path / "a") == a, "the same directory, the same area on every rank"
    (tmp_path / "a").rename(tmp_path / "a2")
    (tmp_path / "a").mkdir()
    assert memfetch.area(tmp_path / "a") != a, "another directory at the same path: another area"
    assert memfetch.area(tmp_path / "missing") is None
    (shm / "ckpt").mkdir()
    assert memfetch.area(shm / "ckpt") is None, "a directory in memory takes no second copy"
    monkeypatch.setenv(memfetch.ENV, "off")
    assert memfetch.area(tmp_path / "b") is None
    monkeypatch.setenv(memfetch.ENV, str(tmp_path / "missing"))
    assert memfetch.area(tmp_path / "b") is None
    shared = shm / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # others could swap this user's entry in it
    monkeypatch.setenv(memfetch.ENV, str(shared))
    assert memfetch.area(tmp_path / "b") is None
    os.chmod(shared, 0o1777)  # sticky, as /dev/shm: they cannot
    assert memfetch.area(tmp_path / "b") is not None


@needs_shm
def test_the_mount_table_tells_a_memory_file_system():
    assert memfetch.in_memory(SHM / "no" / "such" / "dir")
    assert not memfetch.in_memory(Path("/proc/self"))


def _put(root: Path, name: str, data: bytes) -> None:
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_bytes(data)


def test_the_view_reads_each_file_from_memory_where_it_landed_else_from_the_directory(tmp_path):
    top, base = tmp_path / "mem", tmp_path / "disk"
    _put(base, "a", b"disk a")
    _put(base, "b", b"disk b")
    _put(top, "a", b"memory a")
    view = Overlay(LocalStorage(top, direct_io=False), LocalStorage(base))
    assert view.read("a") == b"memory a" and view.read("b") == b"disk b"
    assert view.size("a") == 8 and view.list() == ["a", "b"]
    assert view.exists("b") and not view.exists("c") and view.exists()
    out = bytearray(4)
    view.read_into("a", 2, memoryview(out))
    assert bytes(out) == b"mory"
    _put(top, "b", b"memory b")  # landed meanwhile (a relayed index): read from memory now
    assert view.read("b") == b"memory b"
    assert view.location == str(base)
    with pytest.raises(CheckpointError, match="read here through a view"):
        view.commit(MANIFEST_NAME, b"{}")
    with pytest.raises(CheckpointError, match="cannot write 'x'"):
        view.open_writer("x", 1)


def _node(shm: Path, tmp_path: Path) -> tuple[Path, LocalStorage, memfetch.FetchView]:
    (tmp_path / "node").mkdir()
    area = memfetch.area(tmp_path / "node")
    assert area is not None
    disk = LocalStorage(tmp_path / "node" / "step-00000001")
    view = memfetch.view(disk, area / "step-00000001")
    assert isinstance(view, memfetch.FetchView)
    return area, disk, view


@needs_shm
def test_a_restore_lands_in_memory_while_it_has_room_and_the_rest_on_disk(shm, tmp_path):
    area, disk, view = _node(shm, tmp_path)
    assert memfetch.landing_target(view, 1 << 20) is view.mem and view.mem.root.is_dir()
    assert os.stat(area.parent).st_mode & 0o777 == 0o700, "the area is this user's alone"
    assert view.budget is not None and 0 < view.budget < shutil.disk_usage(shm).free // 2
    left = view.budget
    assert memfetch.landing_target(view, left + 1) is disk, "over what memory can spare: to disk"
    assert memfetch.landing_target(view, left) is view.mem, "the budget is the restore's, not each transfer's"
    assert memfetch.landing_target(view, 1) is disk
    assert memfetch.landing_target(disk, 1 << 20) is disk, "a replica (no view) lands where it is sent"
    assert memfetch.disk_of(view) is disk and memfetch.disk_of(disk) is disk
    assert memfetch.view(disk, None) is disk


@needs_shm
def test_an_area_whose_parent_is_not_this_users_alone_is_not_used(shm, tmp_path):
    (tmp_path / "node").mkdir()
    area = memfetch.area(tmp_path / "node")
    assert area is not None
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / area.name / "s").mkdir(parents=True)
    (elsewhere / area.name / "s" / MANIFEST_NAME).write_bytes(b"planted")
    area.parent.symlink_to(elsewhere)  # planted before the first restore
    disk = LocalStorage(tmp_path / "node" / "s")
    assert memfetch.view(disk, area / "s") is disk, "what is there is not read"
    assert memfetch.claim(area) is None
    premade = memfetch.FetchView(LocalStorage(area / "s"), disk)  # a view made before it was planted
    assert memfetch.landing_target(premade, 1 << 20) is disk, "nor is anything landed there"
    memfetch.wipe(area)
    assert (elsewhere / area.name / "s" / MANIFEST_NAME).exists(), "nor removed through the link"
    area.parent.unlink()
    area.parent.mkdir()
    os.chmod(area.parent, 0o755)  # others may list or enter it
    assert memfetch.view(disk, area / "s") is disk
    assert memfetch.landing_target(premade, 1 << 20) is disk


@needs_shm
def test_an_area_is_held_by_one_manager_and_a_crashs_leftovers_are_swept(shm, tmp_path):
    for name in ("mine", "crashed", "live"):
        (tmp_path / name).mkdir()
    mine, crashed, live = (memfetch.area(tmp_path / n) for n in ("mine", "crashed", "live"))
    assert mine is not None and crashed is not None and live is not None
    held = memfetch.claim(live)  # another manager's, alive
    assert held is not None
    (live / "step-00000001").mkdir(parents=True)
    (crashed / "step-00000001").mkdir(parents=True)  # its process died: its lock is free
    (crashed.parent / f"{crashed.name}.lock").touch()
    (mine / "step-00000002").mkdir(parents=True)  # this directory's last manager left it
    (tmp_path / "old").mkdir()
    lockless = memfetch.area(tmp_path / "old")
    assert lockless is not None
    (lockless / "step-00000001").mkdir(parents=True)  # left without its lock file
    fd = memfetch.claim(mine)
    assert fd is not None
    assert not crashed.exists() and not mine.exists() and not lockless.exists(), "leftovers removed"
    assert not (crashed.parent / f"{crashed.name}.lock").exists(), "with their locks"
    assert (live / "step-00000001").is_dir(), "a live manager's area kept"
    assert memfetch.claim(mine) is None, "one holder at a time"
    (mine / "x").mkdir(parents=True)
    memfetch.release(fd, mine)
    assert not mine.exists() and not (mine.parent / f"{mine.name}.lock").exists()
    memfetch.release(held, live)
    assert not list(mine.parent.iterdir()), "nothing left once every manager closed"


def _fetched(mem: Path, save_id: str = "abc") -> dict[str, bytes]:
    """A memory copy as a restore leaves it: saving rank 0 whole, rank 1's index and a
    sparse part of one of its shards (marked partial), and the manifest."""
    files = {
        index_name(0, save_id): b"index 0",
        shard_name(0, 0, save_id): os.urandom(3 << 20),
        index_name(1, save_id): b"index 1",
        MANIFEST_NAME: b'{"manifest": 1}',
    }
    for name, data in files.items():
        _put(mem, name, data)
    (mem / partial_name(1)).write_bytes(b"")
    sparse = mem / shard_name(1, 0, save_id)
    with sparse.open("wb") as f:
        f.truncate(8 << 20)
        f.seek(4 << 20)
        f.write(b"x" * 8192)
    return files


def test_settling_copies_the_memory_copy_as_a_landing_would_have_left_it(tmp_path):
    mem, disk_root = tmp_path / "mem", tmp_path / "ckpt"
    files = _fetched(mem)
    disk = LocalStorage(disk_root / "step-00000001")
    _put(disk.root, shard_name(0, 0, "abc"), b"a part an interrupted fetch left")
    copied = memfetch.settle(mem, disk)
    for name, data in files.items():
        assert (disk.root / name).read_bytes() == data, name
    assert not (disk.root / partial_name(0)).exists() and (disk.root / partial_name(1)).exists()
    sparse = disk.root / shard_name(1, 0, "abc")
    assert sparse.stat().st_size == 8 << 20 and sparse.stat().st_blocks * 512 < 1 << 20, "kept sparse"
    with sparse.open("rb") as f:
        f.seek(4 << 20)
        assert f.read(8192) == b"x" * 8192
    assert copied == sum(len(d) for n, d in files.items() if n != MANIFEST_NAME) + 8192


def test_a_settle_that_fails_part_way_leaves_the_ranks_marked_partial_and_no_manifest(tmp_path):
    mem, disk_root = tmp_path / "mem", tmp_path / "ckpt"
    _fetched(mem)
    disk = LocalStorage(disk_root / "step-00000001")
    (disk.root / shard_name(0, 0, "abc")).mkdir(parents=True)  # a name the copy cannot replace
    with pytest.raises(OSError):
        memfetch.settle(mem, disk)
    assert (disk.root / partial_name(0)).exists() and (disk.root / partial_name(1)).exists()
    assert not (disk.root / MANIFEST_NAME).exists()
    assert inventory(LocalStorage(disk_root)) == (), "no step is taken for held"


def test_settling_writes_group_directories_and_never_through_a_link(tmp_path):
    mem, disk_root = tmp_path / "mem", tmp_path / "ckpt"
    index, shard = f"g00001/{index_name(1024, 'abc')}", f"g00001/{shard_name(1024, 0, 'abc')}"
    _put(mem, index, b"index")
    _put(mem, shard, b"y" * 5000)
    _put(mem, MANIFEST_NAME, b"{}")
    disk = LocalStorage(disk_root / "step-00000001")
    memfetch.settle(mem, disk)
    assert (disk.root / index).read_bytes() == b"index" and (disk.root / shard).read_bytes() == b"y" * 5000
    outside = tmp_path / "outside"
    outside.mkdir()
    again = LocalStorage(disk_root / "step-00000002")
    again.root.mkdir()
    (again.root / "g00001").symlink_to(outside)
    with pytest.raises(CheckpointError, match="symbolic link"):
        memfetch.settle(mem, again)
    assert not list(outside.iterdir()) and not (again.root / MANIFEST_NAME).exists()


def test_a_settle_told_to_stop_gives_up_with_the_ranks_marked(tmp_path):
    mem, disk_root = tmp_path / "mem", tmp_path / "ckpt"
    _fetched(mem)
    disk = LocalStorage(disk_root / "step-00000001")
    stop = threading.Event()
    stop.set()
    with pytest.raises(CheckpointError, match="stopped"):
        memfetch.settle(mem, disk, stop)
    assert (disk.root / partial_name(0)).exists() and not (disk.root / MANIFEST_NAME).exists()


def test_nothing_fetched_settles_nothing(tmp_path):
    (tmp_path / "mem").mkdir()
    disk = LocalStorage(tmp_path / "ckpt" / "step-00000001")
    assert memfetch.settle(tmp_path / "mem", disk) == 0 and not disk.root.exists()
