"""Only regular files are read: a FIFO, a directory or a symbolic link planted in a checkpoint is
refused at once with a CheckpointError naming it, never followed or blocked on."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import stashpoint
from stashpoint._core.sealed import MAX_MANIFEST_BYTES
from stashpoint._tools.inspect import describe, list_steps

pytestmark = pytest.mark.timeout(60)  # a regression blocks forever on the FIFO: fail instead


def _saved(path):
    stashpoint.save({"w": torch.ones(10)}, path)
    return next(p for p in path.iterdir() if p.name.startswith("shard-"))


def _plant(p, kind: str) -> None:
    data = p.read_bytes() if p.exists() else b""
    p.unlink()
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "dir":
        p.mkdir()
    else:
        real = p.with_name("elsewhere")
        real.write_bytes(data)
        p.symlink_to(real.name)


@pytest.mark.parametrize("kind", ["fifo", "dir", "symlink"])
def test_a_planted_manifest_is_refused_by_load_verify_and_inspect(tmp_path, kind):
    _saved(tmp_path / "c")
    _plant(tmp_path / "c" / "manifest.json", kind)
    with pytest.raises(stashpoint.CorruptCheckpointError, match=r"manifest\.json is a .*not a regular file"):
        stashpoint.load({"w": torch.zeros(10)}, tmp_path / "c")
    with pytest.raises(stashpoint.CheckpointError, match="not a regular file"):
        describe(tmp_path / "c")
    report = stashpoint.verify(tmp_path / "c")
    assert not report.ok and "not a regular file" in report.problems[0]


@pytest.mark.parametrize("kind", ["fifo", "dir", "symlink"])
def test_a_planted_shard_is_refused_by_load_and_listed_by_verify(tmp_path, kind):
    shard = _saved(tmp_path / "c")
    _plant(shard, kind)
    w = torch.zeros(10)
    with pytest.raises(stashpoint.CorruptCheckpointError, match=f"{shard.name} is a .*not a regular file"):
        stashpoint.load({"w": w}, tmp_path / "c")
    assert torch.equal(w, torch.zeros(10))
    report = stashpoint.verify(tmp_path / "c")
    assert not report.ok and any(shard.name in p and "not a regular file" in p for p in report.problems)


def test_the_manager_and_ls_step_over_a_planted_newest_manifest(tmp_path):
    with stashpoint.CheckpointManager(tmp_path / "run", keep_last=5) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((10,), float(step))})
            mgr.wait()
    _plant(tmp_path / "run" / "step-00000002" / "manifest.json", "fifo")
    steps = {s.step: s for s in list_steps(tmp_path / "run")}
    assert steps[1].status == "committed" and steps[2].status != "committed"
    state = {"w": torch.zeros(10)}
    with stashpoint.CheckpointManager(tmp_path / "run", keep_last=5) as mgr:
        assert mgr.restore(state) == 1
    assert torch.equal(state["w"], torch.ones(10))


@pytest.mark.parametrize("kind", ["dir", "symlink"])
def test_restore_falls_back_over_a_newest_manifest_that_is_no_regular_file(tmp_path, kind):
    with stashpoint.CheckpointManager(tmp_path / "run", keep_last=5) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((10,), float(step))})
            mgr.wait()
    _plant(tmp_path / "run" / "step-00000002" / "manifest.json", kind)
    assert {s.step for s in list_steps(tmp_path / "run")} >= {1}
    state = {"w": torch.zeros(10)}
    with stashpoint.CheckpointManager(tmp_path / "run", keep_last=5) as mgr:
        assert mgr.restore(state) == 1


def test_the_manager_ignores_names_it_does_not_write(tmp_path):
    with stashpoint.CheckpointManager(tmp_path / "run", keep_last=5) as mgr:
        mgr.save(3, {"w": torch.ones(10)})
        mgr.wait()
    real = tmp_path / "run" / "step-00000003"
    for name in ("step-000000007", "step-\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0669", "step-00000009\n"):
        (tmp_path / "run" / name).mkdir()
        (tmp_path / "run" / name / "manifest.json").write_bytes((real / "manifest.json").read_bytes())
    assert [s.step for s in list_steps(tmp_path / "run")] == [3]
    with stashpoint.CheckpointManager(tmp_path / "run", keep_last=5) as mgr:
        assert mgr.steps() == [3]
        assert mgr.restore({"w": torch.zeros(10)}) == 3


def test_a_planted_lock_symlink_or_file_paths_give_clear_errors_and_write_nothing_outside(tmp_path):
    (tmp_path / "run").mkdir()
    outside = tmp_path / "outside.txt"
    (tmp_path / "run" / ".stashpoint-manager.lock").symlink_to(outside)
    with pytest.raises(stashpoint.CheckpointError, match="lock file"):
        stashpoint.CheckpointManager(tmp_path / "run")
    assert not outside.exists()
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(stashpoint.CheckpointError, match="not a directory"):
        stashpoint.CheckpointManager(tmp_path / "a_file")
    with pytest.raises(stashpoint.CheckpointError, match="not a directory"):
        stashpoint.save({"w": torch.ones(2)}, tmp_path / "a_file")
    with stashpoint.CheckpointManager(tmp_path / "run2") as mgr:
        (tmp_path / "run2" / "step-00000005").write_text("planted")
        (tmp_path / "run2" / "step-00000006").symlink_to(outside)
        for step in (5, 6):
            mgr.save(step, {"w": torch.ones(2)})
        mgr.wait()
        assert mgr.steps() == [5, 6]
    assert not outside.exists()


def test_a_step_planted_as_a_link_is_never_restored_by_number(tmp_path):
    stashpoint.save({"w": torch.full((2,), 42.0)}, tmp_path / "elsewhere")
    with stashpoint.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"w": torch.ones(2)}).wait()
        (tmp_path / "run" / "step-00000002").symlink_to(tmp_path / "elsewhere")
        assert mgr.steps() == [1]
        out = {"w": torch.zeros(2)}
        with pytest.raises(stashpoint.CheckpointError, match=r"step-00000002 is a symbolic link; .*stashpoint\.load"):
            mgr.restore(out, step=2)
        assert torch.equal(out["w"], torch.zeros(2))
        assert mgr.restore(out) == 1 and torch.equal(out["w"], torch.ones(2))


def test_a_users_own_link_to_a_directory_is_followed_as_a_root_or_a_checkpoint_path(tmp_path):
    """``runs -> /scratch/...``: before, a linked root was refused ("not a directory"), and a
    linked remote_root taken for an unreachable one, so steps saved before the tier was added
    were never uploaded and stayed protected from the retention for good."""
    for d in ("disk", "far"):
        (tmp_path / d).mkdir()
        (tmp_path / f"{d}-link").symlink_to(tmp_path / d)
    stashpoint.save({"w": torch.ones(2)}, tmp_path / "disk-link")
    out = {"w": torch.zeros(2)}
    stashpoint.load(out, tmp_path / "disk-link")
    assert out["w"][0] == 1.0 and (tmp_path / "disk" / "manifest.json").exists()
    with stashpoint.CheckpointManager(tmp_path / "disk-link" / "run") as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((2,), float(step))})
    (tmp_path / "disk" / "runs").mkdir()
    (tmp_path / "disk" / "runs" / "a").symlink_to(tmp_path / "disk" / "run")
    with stashpoint.CheckpointManager(
        tmp_path / "disk" / "runs" / "a", remote_root=tmp_path / "far-link", keep_last=1
    ) as mgr:
        mgr.save(3, {"w": torch.full((2,), 3.0)})
        mgr.wait()
        assert mgr.remote_steps() == [1, 2, 3], "the steps saved before the tier was added are uploaded at open"
        assert mgr.steps() == [3], "and no longer held back from the retention"


def test_hostile_metrics_in_one_step_neither_stop_retention_nor_break_ls(tmp_path):
    from stashpoint._core.format import seal
    from stashpoint._core.naming import MANIFEST_NAME

    with stashpoint.CheckpointManager(tmp_path / "run", keep_last=1) as mgr:
        mgr.save(1, {"w": torch.ones(2)}, metrics={"loss": 1.0})
        mgr.wait()
        manifest = tmp_path / "run" / "step-00000001" / MANIFEST_NAME
        import json

        doc = json.loads(manifest.read_bytes())
        doc.pop("checksum")
        doc["metadata"]["stashpoint.metrics"] = "[" * 20_000 + "]" * 20_000  # nested past any recursion limit
        manifest.write_bytes(seal(doc))
        for step in (2, 3):
            mgr.save(step, {"w": torch.ones(2)}, metrics={"loss": 0.5})
            mgr.wait()
        assert mgr.steps() == [3]  # the hostile step was deleted by the same rules as any other
    (tmp_path / "run" / "step-00000003" / MANIFEST_NAME).write_bytes(seal(doc))
    steps = list_steps(tmp_path / "run")
    assert [(s.step, s.status, s.metrics) for s in steps] == [(3, "committed", {})]


def test_verify_of_a_run_directory_checks_every_step_and_lists_what_the_manager_did_not_write(tmp_path):
    run = tmp_path / "run"
    with stashpoint.CheckpointManager(run, keep_last=5) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((10,), float(step))})
            mgr.wait()
    (run / "step-000000007").mkdir()  # foreign: nine digits
    (run / "notes.txt").write_text("mine")
    (run / "step-00000004").mkdir()  # partial: no manifest
    rep = stashpoint.verify(run)
    assert rep.ok and rep.steps == 3 and rep.files == 3, rep
    text = "\n".join(rep.warnings)
    assert "step-000000007 was not written by stashpoint's manager" in text
    assert "notes.txt was not written" in text and "step 4 is partial" in text
    assert "step-00000001" not in text and ".stashpoint-manager.lock" not in text
    shard = next((run / "step-00000002").glob("shard-*"))
    with open(shard, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    rep = stashpoint.verify(run)
    assert not rep.ok and rep.steps == 3
    assert all(p.startswith("step 2: ") for p in rep.problems) and rep.problems, rep.problems
    out = subprocess.run(
        [sys.executable, "-m", "stashpoint", "verify", "-q", str(run)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 1 and "problem: step 2:" in out.stdout and "notes.txt was not written" in out.stdout


BIG = MAX_MANIFEST_BYTES + (64 << 20)


class _SwapAfterSize(stashpoint._storage.LocalStorage):
    """The race a concurrent writer wins: right after a size is taken, the file is replaced
    (a real rename on disk) by a larger one, 64 MiB past the manifest's cap (sparse)."""

    def size(self, name: str) -> int:
        got = super().size(name)
        big = self.root / f"{name}.big"
        with big.open("wb") as f:
            f.truncate(BIG)
        big.rename(self.root / name)
        return got


@pytest.mark.parametrize("name", ["index", "manifest.json"])
def test_a_manifest_or_index_swapped_for_a_larger_file_after_its_size_is_read_only_to_its_bound(tmp_path, name):
    """Before: the file was read to its end, however large it had become."""
    _saved(tmp_path / "ck")
    target = next(p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith(name))
    storage = _SwapAfterSize(tmp_path / "ck")
    read = []
    real_read = stashpoint._storage.LocalStorage.read

    def counted(self, n, offset=0, length=None):
        out = real_read(self, n, offset, length)
        read.append(len(out))
        return out

    storage.read = counted.__get__(storage)
    if name == "index":  # the manifest read plainly, then the index raced
        storage.size = super(_SwapAfterSize, storage).size
        head = stashpoint._load.manifest.read_head(storage)
        storage.size = _SwapAfterSize.size.__get__(storage)
        with pytest.raises(stashpoint.CorruptCheckpointError, match="does not match the manifest's checksum"):
            stashpoint._load.manifest.read_index(storage, head, 0)
    else:
        with pytest.raises(stashpoint.CorruptCheckpointError):
            stashpoint._load.manifest.read_head(storage)
    assert (tmp_path / "ck" / target).stat().st_size == BIG
    assert max(read) <= (MAX_MANIFEST_BYTES + 1 if name == "manifest.json" else 1 << 20), read


def test_dropping_older_replicas_touches_only_the_step_directories_the_manager_writes(tmp_path):
    """Before: every name starting "step-" was cleaned (a user's step-backup, a step set aside
    for inspection), and a replica marker that was a directory failed the replicated save."""
    from stashpoint._dist.transfer import _drop_older_replicas

    newest = tmp_path / "step-00000003"
    newest.mkdir()
    for name in ("step-backup", "step-00000001.damaged-20260101-000000", "step-00000002"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "replica-r00001").write_bytes(b"")
        (tmp_path / name / "shard-r00001-0000-abcd.safetensors").write_bytes(b"data")
    (tmp_path / "step-00000004").mkdir()
    (tmp_path / "step-00000004" / "replica-r00001").mkdir()  # not a marker of ours
    _drop_older_replicas(newest)
    for kept in ("step-backup", "step-00000001.damaged-20260101-000000"):
        assert len(list((tmp_path / kept).iterdir())) == 2, kept
    assert list((tmp_path / "step-00000002").iterdir()) == [], "the older step's replica goes"
    assert (tmp_path / "step-00000004" / "replica-r00001").is_dir()
