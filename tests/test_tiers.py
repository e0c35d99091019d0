"""Local-plus-remote tiers: commit locally, copy to the remote tier in the background, restore
from the best copy. The remote tier here is a second directory (a shared filesystem); the same
manager on an S3 remote is tested in test_s3_manager.py."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import ClassVar

import pytest
import torch

import stashpoint
from stashpoint._manager.restoring import try_in_order
from stashpoint._manager.tiers import restore_order
from stashpoint._manager.upload import rank_problem
from stashpoint._storage import LocalStorage
from test_errors import FailingStorage


def _state(v: float) -> dict:
    torch.manual_seed(int(v))
    return {"w": torch.randn(50_000), "b": torch.full((10,), float(v)), "step": int(v)}


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


def test_a_managers_last_restore_says_what_it_did(tmp_path):
    with stashpoint.CheckpointManager(tmp_path / "run", keep_last=2) as mgr:
        assert mgr.last_restore is None, "before any restore"
        assert mgr.restore(_state(0)) is None
        empty = mgr.last_restore
        assert empty is not None and (empty.step, empty.tier, empty.order) == (None, None, ())
        mgr.save(3, _state(3))
        mgr.wait()
        assert mgr.restore(_state(0)) == 3
        report = mgr.last_restore
        assert report is not None and (report.step, report.tier) == (3, "local")
        assert report.order == ((3, "local"),) and report.passed_by == ()
        assert isinstance(report, stashpoint.RestoreReport)


def test_restore_order():
    want = [(5, "local"), (4, "remote"), (3, "local"), (3, "remote"), (1, "remote")]
    assert restore_order([3, 5], [1, 3, 4], None) == want
    assert restore_order([3], [3], 3) == [(3, "local"), (3, "remote")]
    assert restore_order([], [2], 3) == []
    assert restore_order([], [], None) == []


def test_a_copy_gone_while_it_was_read_is_passed_by_and_not_set_aside_as_damaged():
    """A copy found gone as it was read (deleted meanwhile, or an object store's lagging answer)
    is passed by for the next, but is no damage: only damaged copies are set aside, and a step
    set aside is hidden from every later restore."""

    def load_one(at):  # type: ignore[no-untyped-def]
        if at == (5, "remote"):
            raise stashpoint.CheckpointNotFoundError("step 5 was deleted while it was read")
        if at == (5, "local"):
            raise stashpoint.CorruptCheckpointError("step 5's shard does not match its checksum")

    found = try_in_order([(5, "local"), (5, "remote"), (4, "local")], None, lambda s, t: (s, t), load_one)
    assert found is not None
    step, tier, damaged = found
    assert (step, tier) == (4, "local")
    assert [(s, t) for s, t, _ in damaged] == [(5, "local")], "the copy gone as it was read is not set aside"
    with pytest.raises(stashpoint.CorruptCheckpointError, match="every copy of step 5 is unusable"):
        try_in_order([(5, "local"), (5, "remote")], 5, lambda s, t: (s, t), load_one)


def test_each_tier_keeps_its_own_steps_and_a_fresh_node_restores_from_remote(tmp_path):
    local, remote = tmp_path / "nvme", tmp_path / "remote"
    with stashpoint.CheckpointManager(local, keep_last=1, remote_root=remote, remote_keep_last=3) as mgr:
        for step in range(1, 6):
            mgr.save(step, _state(step))
        mgr.wait()
        assert mgr.steps() == [5]
        assert mgr.remote_steps() == [3, 4, 5]
    for step in (3, 4, 5):  # every remote copy is whole and verifies
        assert stashpoint.verify(remote / f"step-{step:08d}").ok
    shutil.rmtree(local)  # a fresh node: no local tier at all
    with stashpoint.CheckpointManager(local, keep_last=1, remote_root=remote) as mgr:
        out = {"w": torch.zeros(50_000), "b": torch.zeros(10), "step": 0}
        assert mgr.restore(out) == 5
        want = _state(5)
        assert torch.equal(out["w"], want["w"]) and out["step"] == 5
        out2 = {"w": torch.zeros(50_000), "b": torch.zeros(10), "step": 0}
        assert mgr.restore(out2, step=3) == 3 and torch.equal(out2["w"], _state(3)["w"])


def test_restore_prefers_the_local_copy_and_falls_back_when_it_is_damaged(tmp_path, caplog):
    local, remote = tmp_path / "nvme", tmp_path / "remote"
    with stashpoint.CheckpointManager(local, keep_last=2, remote_root=remote) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        mgr.wait()
    # prove which copy is read: make the remote copy of step 2 differ... by damaging the local one
    (shard,) = (local / "step-00000002").glob("shard-*")
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with stashpoint.CheckpointManager(local, keep_last=2, remote_root=remote) as mgr:
        out = _state(0)
        assert mgr.restore(out) == 2, "the remote copy of the same step, not the older local one"
        assert torch.equal(out["w"], _state(2)["w"])
        assert "local copy of step 2 is unusable" in caplog.text
        assert mgr.steps() == [1], "the damaged local copy was moved aside"
        assert len(list(local.glob("step-00000002.damaged-*"))) == 1
        assert mgr.remote_steps() == [1, 2]
        report = mgr.last_restore
        assert report is not None and (report.step, report.tier) == (2, "remote")
        assert report.order == ((2, "local"), (2, "remote"), (1, "local"), (1, "remote"))
        assert [p[:2] for p in report.passed_by] == [(2, "local")] and "checksum" in report.passed_by[0][2]
        assert report.fetched == {} and report.seconds > 0
        out = _state(0)
        assert mgr.restore(out) == 2, "now from the remote tier"
        assert mgr.last_restore is not None and mgr.last_restore.passed_by == ()


class _FailingRemote(FailingStorage):
    """A remote tier whose disk fills up after a few bytes (fault injection by subclassing)."""

    def __init__(self, root, direct_io: bool = True):
        super().__init__(root, budget=1000)

    def child(self, name):
        return _FailingRemote(self.root / name)


def test_a_failed_upload_keeps_the_local_copy_and_is_retried_when_the_root_opens_again(tmp_path):
    local, remote = tmp_path / "nvme", tmp_path / "remote"
    with stashpoint.CheckpointManager(local, keep_last=1, remote_root=_FailingRemote(remote)) as mgr:
        mgr.save(1, _state(1)).wait()  # the local save itself succeeds
        with pytest.raises(stashpoint.CheckpointError, match=r"uploading step 1 to .* failed.*local copy .* is kept"):
            mgr.wait()
        assert mgr.steps() == [1] and mgr.remote_steps() == []
        mgr.save(2, _state(2))
        with pytest.raises(stashpoint.CheckpointError, match="uploading step 2"):
            mgr.wait()
        assert mgr.steps() == [1, 2], "keep_last=1, but a step is never deleted before it was uploaded"
    assert _steps(remote) == [], "a failed upload removes what it copied; nothing committed"
    with stashpoint.CheckpointManager(local, keep_last=1, remote_root=remote) as mgr:
        mgr.wait()  # the catch-up uploads at open, then the local retention
        assert mgr.remote_steps() == [1, 2]
        assert mgr.steps() == [2]
    assert stashpoint.verify(remote / "step-00000001").ok and stashpoint.verify(remote / "step-00000002").ok


def test_local_retention_never_deletes_a_step_before_it_is_uploaded(tmp_path):
    import threading

    gate = threading.Event()

    class SlowRemote(LocalStorage):
        def child(self, name):
            return SlowRemote(self.root / name)

        def open_writer(self, name, size):
            gate.wait(30)
            return super().open_writer(name, size)

    local, remote = tmp_path / "nvme", tmp_path / "remote"
    with stashpoint.CheckpointManager(local, keep_last=1, remote_root=SlowRemote(remote)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step)).wait()
        assert mgr.steps() == [1, 2, 3], "keep_last=1, but 1 and 2 are still waiting for their upload"
        gate.set()
        mgr.wait()
        assert mgr.steps() == [3] and mgr.remote_steps() == [1, 2, 3]


def test_remote_root_must_be_another_place_and_a_refused_manager_releases_the_root(tmp_path):
    for remote in (tmp_path / "a", tmp_path / "a" / "sub", str(tmp_path / "a") + "/"):
        with pytest.raises(ValueError, match="remote_root must be another place"):
            stashpoint.CheckpointManager(tmp_path / "a", remote_root=remote)
    stashpoint.CheckpointManager(tmp_path / "a", remote_root=tmp_path / "b").close()  # the lock was released


def test_remote_keep_last_none_keeps_every_remote_step_and_keep_every_applies_locally(tmp_path):
    local, remote = tmp_path / "nvme", tmp_path / "remote"
    with stashpoint.CheckpointManager(local, keep_last=1, keep_every=4, remote_root=remote) as mgr:
        for step in range(1, 7):
            mgr.save(step, _state(step))
        mgr.wait()
        assert mgr.steps() == [4, 6] and mgr.remote_steps() == [1, 2, 3, 4, 5, 6]


def test_a_skipped_save_is_not_an_upload_failure(tmp_path):
    import threading

    gate = threading.Event()

    class Slow(LocalStorage):
        def open_writer(self, name, size):
            gate.wait(30)
            return super().open_writer(name, size)

    local, remote = tmp_path / "nvme", tmp_path / "remote"
    with stashpoint.CheckpointManager(local, keep_last=None, on_busy="skip", remote_root=remote) as mgr:
        mgr.storage_class = Slow
        mgr.save(1, _state(1))
        skipped = mgr.save(2, _state(2))  # the first is still persisting: skipped
        gate.set()
        assert skipped.wait().skipped
        mgr.wait()  # no error: nothing to upload for a skipped save
        assert mgr.steps() == [1] and mgr.remote_steps() == [1]


def test_catch_up_at_open_uploads_only_what_the_remote_tier_keeps_and_protects_it(tmp_path):
    local, remote = tmp_path / "nvme", tmp_path / "remote"
    with stashpoint.CheckpointManager(local, keep_last=None) as mgr:  # no remote yet: three local steps
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
        mgr.wait()
    with stashpoint.CheckpointManager(local, keep_last=1, remote_root=remote, remote_keep_last=2) as mgr:
        mgr.save(4, _state(4))  # retention runs while the catch-up may still be uploading
        mgr.wait()
        assert mgr.remote_steps() == [3, 4], "step 1 and 2 would be dropped by remote_keep_last=2: not uploaded"
        assert mgr.steps() == [4]
    uploads = sorted(p.name for p in remote.iterdir())
    assert uploads == ["step-00000003", "step-00000004"]


def test_a_step_saved_anew_after_a_rewind_replaces_the_remote_copy(tmp_path):
    local, remote = tmp_path / "nvme", tmp_path / "remote"
    with stashpoint.CheckpointManager(local, keep_last=None, remote_root=remote) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        mgr.wait()
    shutil.rmtree(local / "step-00000002")  # the run rewinds to step 1 and trains another way
    with stashpoint.CheckpointManager(local, keep_last=None, remote_root=remote) as mgr:
        mgr.wait()
        mgr.save(2, _state(20))
        mgr.wait()
    out = _state(0)
    stashpoint.load(out, remote / "step-00000002")
    assert torch.equal(out["w"], _state(20)["w"]), "the remote copy is the new save, not the old one"


def test_two_ranks_upload_their_own_files_and_restore_agrees_on_the_copy(tmp_path, monkeypatch):
    from dist_util import run_world

    worker = Path(__file__).with_name("tier_worker.py")
    local, remote = tmp_path / "nvme", tmp_path / "remote"
    monkeypatch.setenv("STASHPOINT_RANKS_PER_DIR", "1")  # each rank's files in a directory of its own
    for r in run_world(2, "save", str(local), str(remote), worker=worker):
        assert r == {"local": [3], "remote": [2, 3]}
    for tier in (local, remote):
        names = sorted(p.name for p in (tier / "step-00000003").iterdir())
        assert names == ["g00000", "g00001", "manifest.json"], names
    manifest = stashpoint._load.manifest.open_checkpoint(remote / "step-00000003")[1]
    assert {f.rank for f in manifest.files} == {0, 1}, "both ranks wrote (and uploaded) shards"
    assert stashpoint.verify(remote / "step-00000003").ok
    # both ranks see the local tier: the local copy
    for r in run_world(2, "restore", str(local), str(remote), worker=worker):
        assert r["step"] == 3 and r["ok"] and r["tier"] == "local"
    # rank 0 has a local copy, rank 1 is a fresh node (an empty local root of its own): every
    # rank takes the remote copy
    shutil.copytree(local, tmp_path / "node0")
    for r in run_world(2, "restore", str(tmp_path / "node{rank}"), str(remote), worker=worker):
        assert r["step"] == 3 and r["ok"] and r["tier"] == "remote"


_CRASHING_UPLOADER = r"""
import sys, time, torch, stashpoint
from stashpoint._storage import LocalStorage

class SlowRemote(LocalStorage):  # a slow network: each block of the copy takes a while
    def child(self, name):
        return SlowRemote(self.root / name)
    def open_writer(self, name, size):
        inner = super().open_writer(name, size)
        class Slow:
            def write(self, data):
                time.sleep(0.2)
                inner.write(data)
            def close(self):
                inner.close()
            def abort(self):
                inner.abort()
        return Slow()

local, remote = sys.argv[1], sys.argv[2]
mgr = stashpoint.CheckpointManager(local, keep_last=2, remote_root=SlowRemote(remote))
torch.manual_seed(0)
state = {"w": torch.randn(3_000_000), "step": 1}  # 12 MB: a few copy blocks of 4 MB
import stashpoint._manager.tiers as tiers
tiers.COPY_BLOCK = 4 * 1024 * 1024
mgr.save(1, state).wait()
print("COMMITTED", flush=True)
time.sleep(60)  # the upload goes on in the background until the parent kills us
"""


def test_a_crash_mid_upload_leaves_the_remote_tier_clean_and_the_next_manager_uploads_again(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT

    local, remote = tmp_path / "nvme", tmp_path / "remote"
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")}
    child = subprocess.Popen(
        [sys.executable, "-c", _CRASHING_UPLOADER, str(local), str(remote)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "COMMITTED"
        deadline = time.monotonic() + 30
        while not list(remote.glob("step-00000001/shard-*")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(remote.glob("step-00000001/shard-*")), "the upload had started"
        child.send_signal(signal.SIGKILL)  # kill -9 in the middle of the upload
        child.wait(10)
    finally:
        child.kill()
    assert not (remote / "step-00000001" / "manifest.json").exists(), "never a committed partial copy"
    with stashpoint.CheckpointManager(local, keep_last=2, remote_root=remote) as mgr:
        mgr.wait()
        assert mgr.steps() == [1] and mgr.remote_steps() == [1], "the catch-up upload at open"
    assert stashpoint.verify(remote / "step-00000001").ok
    torch.manual_seed(0)
    out = {"w": torch.zeros(3_000_000), "step": 0}
    stashpoint.load(out, remote / "step-00000001")
    torch.manual_seed(0)
    assert torch.equal(out["w"], torch.randn(3_000_000))


def test_restoring_a_step_whose_copies_are_both_damaged_names_both(tmp_path):
    local, remote = tmp_path / "nvme", tmp_path / "remote"
    with stashpoint.CheckpointManager(local, keep_last=None, remote_root=remote) as mgr:
        mgr.save(1, _state(1))
        mgr.wait()
    for root in (local, remote):
        (shard,) = (root / "step-00000001").glob("shard-*")
        data = bytearray(shard.read_bytes())
        data[-10] ^= 0xFF
        shard.write_bytes(bytes(data))
    both = r"every copy of step 1(.|\n)*local(.|\n)*remote"
    with (
        stashpoint.CheckpointManager(local, keep_last=None, remote_root=remote) as mgr,
        pytest.raises(stashpoint.CorruptCheckpointError, match=both),
    ):
        mgr.restore(_state(0), step=1)


def _damage(shard, where: str) -> None:
    """Damage ``shard``: 64 bytes of its data, or one bit of its header's padding (JSON that
    still parses)."""
    with shard.open("r+b") as f:
        if where == "data":
            f.seek(shard.stat().st_size // 2)
            f.write(b"\xff" * 64)
        else:
            at = 8 + int.from_bytes(f.read(8), "little") - 1
            f.seek(at)
            byte = f.read(1)
            assert byte == b" ", "the header ends in padding"
            f.seek(at)
            f.write(b"!")


def _step_2_damaged_before_its_upload(local: Path, remote: Path, state: dict, where: str) -> None:
    """Step 1 committed on both tiers; step 2 committed locally and never uploaded (as a crash
    before its upload leaves it), then its largest shard damaged (its data, or its header)."""
    with stashpoint.CheckpointManager(local, keep_last=1, remote_root=remote, remote_keep_last=1) as mgr:
        mgr.save(1, state).wait()
    with stashpoint.CheckpointManager(local, keep_last=1) as mgr:  # no remote tier: no upload
        mgr.save(2, state).wait()
    _damage(max((local / "step-00000002").rglob("shard-*"), key=lambda p: p.stat().st_size), where)


@pytest.mark.parametrize("where", ["data", "header"])
def test_a_local_step_damaged_before_its_upload_fails_it_and_the_good_remote_step_stays(tmp_path, caplog, where):
    """Step 2 committed locally, not uploaded (as a crash before its upload leaves it), then
    damaged on the local disk (its data, or one byte of a shard's header): the catch-up at the
    next open must refuse it, not let the remote retention (remote_keep_last=1) replace the
    good remote step 1 with it. The check a node-local restore makes of a rank's files finds
    the same damage."""
    local, remote = tmp_path / "nvme", tmp_path / "remote"
    state = {"w": torch.arange(1 << 20, dtype=torch.float32)}
    _step_2_damaged_before_its_upload(local, remote, state, where)
    assert rank_problem(LocalStorage(local / "step-00000002"), 0) is not None
    with (
        caplog.at_level(logging.ERROR, logger="stashpoint"),
        stashpoint.CheckpointManager(local, keep_last=1, remote_root=remote, remote_keep_last=1) as mgr,
    ):
        mgr.wait()  # the catch-up at open: its failure is logged, the step uploaded again at the next open
        assert re.search(r"uploading step 2 .* does not match its checksums .* not uploaded", caplog.text)
        assert mgr.remote_steps() == [1], "the good remote step is kept"
        out = {"w": torch.zeros(1 << 20)}
        assert mgr.restore(out) == 1
        assert torch.equal(out["w"], state["w"])
    assert _steps(remote) == ["step-00000001"]


def test_a_step_saved_anew_after_its_damaged_copy_was_set_aside_is_not_kept_for_that_failure(tmp_path):
    """The catch-up at open refuses a damaged step 2 (kept locally for a later manager to
    upload), the restore sets it aside and training saves step 2 anew: that failure protected
    the copy set aside, not the new step, which the local retention deletes once it is uploaded
    and newer steps committed. It was kept for the rest of the manager's life."""
    local, remote = tmp_path / "nvme", tmp_path / "remote"
    state = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    _step_2_damaged_before_its_upload(local, remote, state, "data")
    with stashpoint.CheckpointManager(local, keep_last=1, remote_root=remote, remote_keep_last=1) as mgr:
        assert mgr.restore({"w": torch.zeros(1 << 16)}) == 1
        for step in range(2, 6):
            mgr.save(step, state)
        mgr.wait()
        assert mgr.steps() == [5], "step 2 of this run was uploaded: nothing keeps it"
        assert mgr.remote_steps() == [5]


def test_a_refused_save_of_a_step_whose_upload_failed_leaves_that_step_kept(tmp_path):
    """On two ranks a refused save still queues its upload, which has nothing to upload: that
    must not take back the protection the failed upload of the committed step gave it (it did
    for a while: keep_last=1 then deleted the only copy of step 1)."""
    from dist_util import run_world

    for r in run_world(2, "refused_save_after_a_failed_upload", str(tmp_path)):
        assert r.get("upload_failed") and r.get("refused"), r
        assert r["after_refused"] == [1], r
        assert r["local"] == [3] and r["remote"] == [1, 2, 3], r  # step 1 went up once step 2's upload did


def test_an_upload_checks_every_block_and_copies_the_bytes_unchanged(tmp_path):
    """The checked copy is the file, byte for byte, for a state of many tensors (tied ones,
    an empty one, one past a checksum block) saved by two-file shards."""
    from stashpoint._manager.upload import copy_file, own_files

    g = torch.Generator().manual_seed(0)
    tied = torch.randn(1000, generator=g)
    state = {"a": tied, "b": tied, "empty": torch.empty(0), "big": torch.randn(5 << 20, generator=g), "s": 3}
    src = tmp_path / "src"
    stashpoint.save(state, src, max_shard_bytes=8 << 20)
    dst = tmp_path / "dst"
    dst.mkdir()
    for up in own_files(LocalStorage(src), 0, 1):
        copy_file(LocalStorage(src), LocalStorage(dst), up)
    shutil.copy(src / "manifest.json", dst / "manifest.json")
    for p in src.rglob("*"):
        if p.is_file():
            assert (dst / p.relative_to(src)).read_bytes() == p.read_bytes(), p.name
    assert stashpoint.verify(dst).ok


class _Unreachable(LocalStorage):
    """A remote tier that cannot be reached while ``down`` (every listing fails)."""

    down = False

    def children(self):  # type: ignore[no-untyped-def]
        if _Unreachable.down:
            raise OSError(113, "No route to host")
        return super().children()

    def open_writer(self, name, size):  # type: ignore[no-untyped-def]
        if _Unreachable.down:
            raise OSError(113, "No route to host")
        return super().open_writer(name, size)

    def child(self, name):  # type: ignore[no-untyped-def]
        return _Unreachable(self.root / name)


def test_a_remote_tier_that_cannot_be_reached_does_not_stop_a_restart_with_a_local_copy(tmp_path, caplog):
    local, remote = tmp_path / "nvme", _Unreachable(tmp_path / "remote")
    with stashpoint.CheckpointManager(local, keep_last=1, remote_root=remote) as mgr:
        mgr.save(1, _state(1)).wait()
    _Unreachable.down = True
    try:
        with caplog.at_level(logging.WARNING, logger="stashpoint"):
            mgr = stashpoint.CheckpointManager(local, keep_last=1, remote_root=remote)  # opens all the same
            out = _state(0)
            assert mgr.restore(out) == 1 and torch.equal(out["w"], _state(1)["w"])
        assert "cannot be reached now" in caplog.text and "listing the remote tier failed" in caplog.text
        mgr.save(2, _state(2)).wait()
        with pytest.raises(stashpoint.CheckpointError, match="uploading step 2"):
            mgr.wait()
        assert mgr.steps() == [1, 2], "nothing local goes while the remote tier cannot say what it holds"
        mgr.close()
    finally:
        _Unreachable.down = False
    with stashpoint.CheckpointManager(local, keep_last=1, remote_root=remote) as mgr:
        mgr.wait()  # back: the catch-up uploads step 2, and the local retention runs
        assert mgr.remote_steps() == [1, 2] and mgr.steps() == [2]


def test_a_save_asks_for_no_more_manifests_as_the_kept_steps_grow(tmp_path, monkeypatch):
    """With keep_every=1 every step is kept, locally and remotely: each save's retention passes
    must not ask every step for its manifest again (a HEAD each on object storage), nor read
    every step's manifest for its metrics (keep_best)."""
    asked = [0]
    real_exists, real_read = LocalStorage.exists, LocalStorage.read

    def exists(self, name=None):  # type: ignore[no-untyped-def]
        asked[0] += 1
        return real_exists(self, name)

    def read(self, name, *args, **kwargs):  # type: ignore[no-untyped-def]
        asked[0] += name == "manifest.json"
        return real_read(self, name, *args, **kwargs)

    monkeypatch.setattr(LocalStorage, "exists", exists)
    monkeypatch.setattr(LocalStorage, "read", read)
    per_save = {}
    with stashpoint.CheckpointManager(
        tmp_path / "r",
        keep_last=2,
        keep_every=1,
        keep_best=(2, "loss"),
        remote_root=tmp_path / "remote",
        remote_keep_last=2,
    ) as mgr:
        for step in range(1, 41):
            asked[0] = 0
            mgr.save(step, _state(step), metrics={"loss": 1.0 / step}).wait()
            mgr.wait()
            per_save[step] = asked[0]
        assert len(mgr.steps()) == 40 and len(mgr.remote_steps()) == 40
    assert per_save[1] <= 10 and max(per_save.values()) <= per_save[1], per_save  # as many at step 40 as at 1


def test_steps_only_the_remote_tier_holds_are_not_called_unreadable_when_a_manager_opens(tmp_path, caplog):
    """Their metrics are read from the remote tier. Before: from the local root, where they
    are not, and the retention logged their manifests as unreadable."""
    nvme, remote = tmp_path / "nvme", tmp_path / "remote"
    with stashpoint.CheckpointManager(nvme, keep_last=1, remote_root=remote, remote_keep_last=2) as mgr:
        for s in range(1, 6):
            mgr.save(s, {"w": torch.full((8,), float(s))}, metrics={"loss": 1.0 / s})
    with stashpoint.CheckpointManager(nvme, keep_last=None) as mgr:  # a crash before step 6's upload
        mgr.save(6, {"w": torch.full((8,), 6.0)})
    caplog.set_level(logging.WARNING, logger="stashpoint")
    with stashpoint.CheckpointManager(nvme, keep_last=1, remote_root=remote, remote_keep_last=2) as mgr:
        mgr.wait()
        assert mgr.remote_steps() == [5, 6]
    assert "could not be read" not in caplog.text, caplog.text


@pytest.mark.parametrize("remote_keep", [None, 2])
def test_steps_whose_uploads_failed_go_up_once_the_remote_tier_answers_again(tmp_path, remote_keep, caplog):
    """Before: kept on the local tier for the rest of the run (a long outage filled the disk)
    until a manager opened later uploaded them. Now after the next upload that commits: all of
    them, or with remote_keep_last those the remote retention keeps (the others are let go)."""
    local, remote = tmp_path / "nvme", _Unreachable(tmp_path / "remote")
    with (
        stashpoint.CheckpointManager(local, keep_last=1, remote_root=remote, remote_keep_last=remote_keep) as mgr,
        caplog.at_level(logging.INFO, logger="stashpoint"),
    ):
        mgr.save(1, _state(1)).wait()
        mgr.wait()
        _Unreachable.down = True
        try:
            for step in (2, 3, 4):
                mgr.save(step, _state(step)).wait()
                with pytest.raises(stashpoint.CheckpointError, match=f"uploading step {step}"):
                    mgr.wait()
            assert mgr.steps() == [2, 3, 4], "kept for their uploads"
        finally:
            _Unreachable.down = False
        mgr.save(5, _state(5)).wait()
        mgr.wait()
        if remote_keep is None:
            assert mgr.remote_steps() == [1, 2, 3, 4, 5] and "answers again: uploading step(s) [2, 3, 4]" in caplog.text
        else:
            assert mgr.remote_steps() == [4, 5] and "uploading step(s) [4]" in caplog.text
        assert mgr.steps() == [5] and not mgr._tier.protected()
    for s in [4, 5] if remote_keep else [1, 2, 3, 4, 5]:
        out = _state(0)
        stashpoint.load(out, tmp_path / "remote" / f"step-{s:08d}")
        assert torch.equal(out["w"], _state(s)["w"])


def test_a_failed_upload_that_fails_again_whenever_the_remote_answers_is_retried_a_few_times(tmp_path, caplog):
    """A local copy damaged since its save fails every upload (its checksums): before the cap it
    was copied again, and removed, after every upload that committed, for the rest of the run."""
    from stashpoint._manager.tiers import MAX_RETRIES

    local, remote = tmp_path / "nvme", _Unreachable(tmp_path / "remote")
    with stashpoint.CheckpointManager(local, keep_last=1, remote_root=remote) as mgr:
        _Unreachable.down = True
        try:
            mgr.save(2, _state(2)).wait()
            with pytest.raises(stashpoint.CheckpointError, match="uploading step 2"):
                mgr.wait()
        finally:
            _Unreachable.down = False
        shard = next((local / "step-00000002").glob("shard-*"))
        data = bytearray(shard.read_bytes())
        data[-100] ^= 0xFF
        shard.write_bytes(bytes(data))
        with caplog.at_level(logging.INFO, logger="stashpoint"):
            for step in range(3, 4 + MAX_RETRIES + 2):
                mgr.save(step, _state(step)).wait()
                mgr.wait()  # a retry's failure is logged, not raised: the step's own upload committed
        tries = caplog.text.count("answers again: uploading step(s) [2]")
        assert tries == MAX_RETRIES, caplog.text[-3000:]
        assert caplog.text.count("tried no more by this run") == 1
        assert 2 in mgr.steps() and 2 in mgr._tier.protected() and 2 not in mgr.remote_steps()


class _StepFails(LocalStorage):
    """A remote tier that refuses the files of the steps named in ``failing`` ("*": of all)."""

    failing: ClassVar[set[str]] = set()

    def open_writer(self, name, size):  # type: ignore[no-untyped-def]
        if self.root.name in _StepFails.failing or "*" in _StepFails.failing:
            raise OSError(5, "Input/output error")
        return super().open_writer(name, size)

    def child(self, name):  # type: ignore[no-untyped-def]
        return _StepFails(self.root / name)


def test_retries_listed_with_uploads_that_fail_are_not_counted(tmp_path, caplog):
    """A retry is counted as it starts. Before, each upload's decision counted the failed steps
    it listed, and uploads that failed themselves never ran them: after a few, the first failed
    step was "tried no more" without one try, and stayed on the local tier."""
    from stashpoint._manager.tiers import MAX_RETRIES

    with stashpoint.CheckpointManager(tmp_path / "nvme", keep_last=1, remote_root=_StepFails(tmp_path / "r")) as mgr:
        _StepFails.failing = {"*"}  # a full or read-only bucket: it lists, takes no writes
        try:
            for step in range(2, 4 + MAX_RETRIES):
                mgr.save(step, _state(step)).wait()
                with pytest.raises(stashpoint.CheckpointError, match=f"uploading step {step}"):
                    mgr.wait()
        finally:
            _StepFails.failing = set()
        with caplog.at_level(logging.INFO, logger="stashpoint"):
            mgr.save(9, _state(9)).wait()
            mgr.wait()
        assert "tried no more" not in caplog.text
        assert mgr.remote_steps() == [*range(2, 4 + MAX_RETRIES), 9] and mgr.steps() == [9]


def test_a_step_saved_again_after_a_rewind_has_retries_of_its_own(tmp_path, caplog):
    """The count of retries went by the step's number: a copy saved again after a rewind had
    none left from the copy before it, and was never retried."""
    remote = _StepFails(tmp_path / "r")
    with stashpoint.CheckpointManager(tmp_path / "nvme", keep_last=1, remote_root=remote) as mgr:
        try:
            for step in range(1, 9):
                _StepFails.failing = {"step-00000005"} if step == 5 else _StepFails.failing
                mgr.save(step, _state(step)).wait()
                if step == 5:
                    with pytest.raises(stashpoint.CheckpointError, match="uploading step 5"):
                        mgr.wait()
            mgr.wait()
            assert "tried no more" in caplog.text and 5 not in mgr.remote_steps()
            mgr.restore(_state(0), step=4)
            mgr.save(5, _state(50)).wait()
            with pytest.raises(stashpoint.CheckpointError, match="uploading step 5"):
                mgr.wait()
        finally:
            _StepFails.failing = set()
        mgr.save(6, _state(60)).wait()
        mgr.wait()
        assert mgr.remote_steps() == [1, 2, 3, 4, 5, 6]
    out = _state(0)
    stashpoint.load(out, tmp_path / "r" / "step-00000005")
    assert torch.equal(out["w"], _state(50)["w"])


def test_the_first_retry_that_fails_leaves_the_rest_for_the_next_upload(tmp_path, caplog):
    """Retries ran back to back, each failing one waiting out the remote's timeout: with many
    failed steps and the remote failing again, the upload (and close()) waited for every one."""
    remote = _StepFails(tmp_path / "r")
    with stashpoint.CheckpointManager(tmp_path / "nvme", keep_last=1, remote_root=remote) as mgr:
        try:
            _StepFails.failing = {f"step-{s:08d}" for s in (2, 3, 4)}
            for step in (1, 2, 3, 4):
                mgr.save(step, _state(step)).wait()
                if step > 1:
                    with pytest.raises(stashpoint.CheckpointError, match=f"uploading step {step}"):
                        mgr.wait()
            mgr.wait()
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="stashpoint"):
                mgr.save(5, _state(5)).wait()
                mgr.wait()  # step 5 commits; the retry of step 2 fails; 3 and 4 are not tried
            assert "uploading step 2 to" in caplog.text and "uploading step 3 to" not in caplog.text
            assert "the upload of step(s) [3, 4] waits for the next upload that commits" in caplog.text
        finally:
            _StepFails.failing = set()
        mgr.save(6, _state(6)).wait()
        mgr.wait()
        assert mgr.remote_steps() == [1, 2, 3, 4, 5, 6] and mgr.steps() == [6]
