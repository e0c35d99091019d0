"""Going back: ``restore(step=K)`` below the newest step and training on (a loss spike), or a
new run saving low steps in an old root. The steps above are another run's: they are moved
aside, in both tiers, so that the retention keeps the new run's steps and a restart resumes
them."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest
import torch

import stashpoint
from stashpoint._storage import LocalStorage


def _state(v: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), float(v))}


def _names(root: Path, kind: str) -> list[str]:
    return sorted(p.name.split(".")[0] for p in root.glob(f"step-*.{kind}-*"))


def _resume(root: Path, **kw) -> tuple[int | None, float]:
    out = _state(0)
    with stashpoint.CheckpointManager(root, **kw) as mgr:
        step = mgr.restore(out)
    return step, out["w"][0].item()


def test_saves_after_a_rewind_are_kept_and_a_restart_resumes_them(tmp_path, caplog):
    root = tmp_path / "run"
    with stashpoint.CheckpointManager(root, keep_last=2) as mgr:
        for s in (100, 200, 300):
            mgr.save(s, _state(s)).wait()
        mgr.wait()  # the retention
        assert mgr.steps() == [200, 300]
        assert mgr.restore(_state(0), step=200) == 200  # back past a loss spike
        with caplog.at_level(logging.WARNING, logger="stashpoint"):
            for s in (210, 220):
                mgr.save(s, _state(s + 0.5)).wait()
                mgr.wait()
        assert mgr.steps() == [210, 220], "the new run's steps are kept, not deleted by the old run's"
    assert "goes back below the steps 300" in caplog.text
    assert _names(root, "rewound") == ["step-00000300"], "moved aside, not deleted"
    assert _resume(root, keep_last=2) == (220, 220.5)
    report = stashpoint.verify(root)
    assert report.ok and any("abandoned by a rewind" in w for w in report.warnings), report.warnings


def test_a_rewind_may_save_the_step_numbers_of_the_run_it_abandoned(tmp_path):
    root = tmp_path / "run"
    with stashpoint.CheckpointManager(root, keep_last=3) as mgr:
        for s in (10, 20, 30):
            mgr.save(s, _state(s)).wait()
        mgr.restore(_state(0), step=10)
        mgr.save(20, _state(20.5)).wait()
        mgr.save(30, _state(30.5)).wait()
        mgr.wait()
        assert mgr.steps() == [10, 20, 30]
    assert _names(root, "rewound") == ["step-00000020", "step-00000030"]
    assert _resume(root) == (30, 30.5)


def test_a_new_run_in_an_old_root_keeps_its_own_steps(tmp_path):
    root = tmp_path / "run"
    with stashpoint.CheckpointManager(root, keep_last=2) as mgr:
        for s in (290, 300):
            mgr.save(s, _state(s)).wait()
    with stashpoint.CheckpointManager(root, keep_last=2) as mgr:  # no restore: a fresh run from step 0
        for s in (10, 20, 30):
            mgr.save(s, _state(s)).wait()
            mgr.wait()
        assert mgr.steps() == [20, 30]
    assert _names(root, "rewound") == ["step-00000290", "step-00000300"]
    assert _resume(root) == (30, 30.0)


def test_a_restore_that_trains_on_from_the_newest_step_moves_nothing(tmp_path):
    root = tmp_path / "run"
    with stashpoint.CheckpointManager(root, keep_last=2) as mgr:
        for s in (1, 2):
            mgr.save(s, _state(s)).wait()
    with stashpoint.CheckpointManager(root, keep_last=2) as mgr:
        assert mgr.restore(_state(0)) == 2
        assert mgr.restore(_state(0), step=1) == 1  # looked at, not trained on
        mgr.restore(_state(0))
        mgr.save(3, _state(3)).wait()
        with pytest.raises(stashpoint.CheckpointError, match="step 3 already has a committed checkpoint"):
            mgr.save(3, _state(3))
        mgr.wait()
        assert mgr.steps() == [2, 3]
    assert not list(root.glob("step-*.*"))


def test_a_rewind_moves_the_remote_tiers_newer_steps_aside_too(tmp_path):
    local, remote = tmp_path / "nvme", tmp_path / "remote"
    with stashpoint.CheckpointManager(local, keep_last=1, remote_root=remote) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, _state(s)).wait()
        mgr.wait()
        assert mgr.remote_steps() == [1, 2, 3]
        mgr.restore(_state(0), step=1)
        mgr.save(2, _state(2.5)).wait()
        mgr.wait()
        assert mgr.remote_steps() == [1, 2]
    assert _names(remote, "rewound") == ["step-00000002", "step-00000003"]
    assert _resume(tmp_path / "fresh-node", remote_root=remote) == (2, 2.5)


def test_a_refused_save_of_a_step_already_there_moves_nothing(tmp_path):
    root = tmp_path / "run"
    with stashpoint.CheckpointManager(root, keep_last=None) as mgr:
        for s in (100, 200, 300):
            mgr.save(s, _state(s)).wait()
    with stashpoint.CheckpointManager(root, keep_last=None) as mgr:  # no restore: a script's slip
        with pytest.raises(stashpoint.CheckpointError, match="step 100 already has a committed checkpoint"):
            mgr.save(100, _state(1))
        assert mgr.steps() == [100, 200, 300]
    assert not list(root.glob("step-*.*"))


def test_looking_at_an_old_step_then_saving_above_the_newest_moves_nothing(tmp_path):
    root = tmp_path / "run"
    with stashpoint.CheckpointManager(root, keep_last=None) as mgr:
        for s in (100, 200, 300):
            mgr.save(s, _state(s)).wait()
        mgr.restore(_state(0), step=100)  # an evaluation of an old step, into another object
        mgr.save(310, _state(310)).wait()
        assert mgr.steps() == [100, 200, 300, 310]
    assert not list(root.glob("step-*.*"))


def test_a_remote_tier_that_cannot_be_listed_is_never_taken_for_an_empty_one(tmp_path):
    """A fresh node (no local step) while the remote tier cannot be listed: the restore raises
    instead of returning None (a run starting over would later hide the remote steps)."""
    from test_tiers import _Unreachable

    remote = _Unreachable(tmp_path / "remote")
    with stashpoint.CheckpointManager(tmp_path / "a", remote_root=remote) as mgr:
        for s in (1, 2):
            mgr.save(s, _state(s)).wait()
    _Unreachable.down = True
    try:
        with (
            stashpoint.CheckpointManager(tmp_path / "fresh", remote_root=remote) as mgr,
            pytest.raises(stashpoint.CheckpointError, match=r"cannot be listed now .* holds no step"),
        ):
            mgr.restore(_state(0))
    finally:
        _Unreachable.down = False
    assert _resume(tmp_path / "fresh2", remote_root=remote) == (2, 2.0)


def test_two_rewinds_within_one_second_keep_both_abandoned_runs(tmp_path):
    """Run B's steps, moved aside in the same second as run A's: a second name, not a failed
    move (which let the save delete one of B's committed steps and leave the other above C)."""
    root = tmp_path / "run"
    with stashpoint.CheckpointManager(root, keep_last=None) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, _state(s)).wait()
        for run in (10, 100):  # runs B and C, each going back to step 1
            mgr.restore(_state(0), step=1)
            for s in (2, 3):
                mgr.save(s, _state(s * run)).wait()
        mgr.wait()
        assert mgr.steps() == [1, 2, 3]
    aside = sorted(p for p in root.glob("step-*.rewound-*"))
    assert _names(root, "rewound") == ["step-00000002"] * 2 + ["step-00000003"] * 2, [p.name for p in aside]
    values = set()
    for p in aside:
        out = _state(0)
        stashpoint.load(out, p)
        values.add(out["w"][0].item())
    assert values == {2.0, 3.0, 20.0, 30.0}, "every abandoned step is kept whole"
    assert _resume(root) == (3, 300.0)


def test_a_rewind_that_cannot_move_a_step_aside_refuses_the_save_and_deletes_nothing(tmp_path, monkeypatch):
    from stashpoint._storage import LocalStorage

    root = tmp_path / "run"
    with stashpoint.CheckpointManager(root, keep_last=None) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, _state(s)).wait()
        mgr.restore(_state(0), step=1)

        def refuse(self, name):
            raise PermissionError(13, "Permission denied (injected)", str(self.root))

        with monkeypatch.context() as m:
            m.setattr(LocalStorage, "move", refuse)
            with pytest.raises(
                stashpoint.CheckpointError, match=r"abandoned by going back to step 1, could not be moved aside"
            ):
                mgr.save(2, _state(20))
        assert mgr.steps() == [1, 2, 3], "nothing deleted"
        mgr.save(2, _state(20)).wait()  # once the cause is gone
        assert mgr.steps() == [1, 2]
    assert _names(root, "rewound") == ["step-00000002", "step-00000003"]


def test_a_new_run_on_a_fresh_node_moves_the_old_runs_remote_step_aside_not_away(tmp_path):
    """Node B, with a fresh disk and no restore, saves step 1 where the remote tier holds an
    old run's 1, 2, 3: all three are set aside (the old step 1 was deleted before the new copy
    was even checked)."""
    remote = tmp_path / "remote"
    with stashpoint.CheckpointManager(tmp_path / "node-a", keep_last=None, remote_root=remote) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, _state(s)).wait()
    with stashpoint.CheckpointManager(tmp_path / "node-b", keep_last=None, remote_root=remote) as mgr:
        mgr.save(1, _state(100)).wait()
        mgr.wait()
        assert mgr.remote_steps() == [1]
    assert _names(remote, "rewound") == ["step-00000001", "step-00000002", "step-00000003"]
    out = _state(0)
    stashpoint.load(out, next(remote.glob("step-00000001.rewound-*")))
    assert out["w"][0].item() == 1.0, "the old run's step 1 is kept whole"
    assert _resume(tmp_path / "node-c", remote_root=remote) == (1, 100.0)


def test_a_rewind_whose_save_cannot_list_the_remote_tier_moves_its_steps_at_the_upload(tmp_path):
    """The remote tier cannot be listed on the training thread at the rewind's save: its steps
    above the rewind are moved aside by the upload of that step, before it copies anything."""
    remote = _Unlisted(tmp_path / "remote")
    with stashpoint.CheckpointManager(tmp_path / "nvme", keep_last=None, remote_root=remote) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, _state(s)).wait()
        _back_to_step_1_unlisted(mgr)
        assert mgr.remote_steps() == [1, 2]
    assert _names(tmp_path / "remote", "rewound") == ["step-00000002", "step-00000003"]
    assert _resume(tmp_path / "fresh-node", remote_root=tmp_path / "remote") == (2, 2.5)


def test_a_rewind_refused_on_the_roots_owner_fails_that_save_on_every_rank_together(tmp_path):
    """Two ranks, a shared root: rank 0 alone moves steps aside, and cannot. Its refusal reached
    rank 0 alone; rank 1's save paired with rank 0's next one and the ranks went out of step."""
    from dist_util import run_world

    results = run_world(2, "rewind_refused", str(tmp_path / "run"), timeout=240)
    for r in results:
        assert "could not be moved aside" in r["first"], r
        assert r["second"] == "ok" and r["second_s"] < 25, r
        assert r["steps"] == [1, 2], r


class _Unlisted(LocalStorage):
    """A remote tier the training thread cannot list while ``down``; uploads of steps 3 and 4
    slow (still queued when the rewind's save comes)."""

    down = False

    def children(self):  # type: ignore[no-untyped-def]
        if _Unlisted.down and threading.current_thread() is threading.main_thread():
            raise OSError(113, "No route to host")
        return super().children()

    def open_writer(self, name, size):  # type: ignore[no-untyped-def]
        if (
            self.root.name in ("step-00000003", "step-00000004")
            and threading.current_thread() is not threading.main_thread()
        ):
            time.sleep(0.5)
        return super().open_writer(name, size)

    def child(self, name):  # type: ignore[no-untyped-def]
        return _Unlisted(self.root / name)


def test_an_unlisted_rewind_is_moved_by_its_own_steps_upload_not_an_older_one_still_queued(tmp_path):
    """The abandoned run's uploads of steps 3 and 4 are still queued at the rewind's save: the
    remote steps above step 1 are moved by step 2's upload (an older upload took the move and
    step 4 then stayed above the new run)."""
    remote = _Unlisted(tmp_path / "remote")
    with stashpoint.CheckpointManager(tmp_path / "nvme", keep_last=None, remote_root=remote) as mgr:
        for s in (1, 2):
            mgr.save(s, _state(s)).wait()
        mgr.wait()
        for s in (3, 4):
            mgr.save(s, _state(s)).wait()  # their uploads still running
        _back_to_step_1_unlisted(mgr)
        assert mgr.remote_steps() == [1, 2]
    assert _resume(tmp_path / "fresh", remote_root=tmp_path / "remote") == (2, 2.5)


def _back_to_step_1_unlisted(mgr: stashpoint.CheckpointManager) -> None:
    """Restore step 1 and save step 2 anew while the training thread cannot list the remote tier."""
    mgr.restore(_state(0), step=1)
    _Unlisted.down = True
    try:
        mgr.save(2, _state(2.5)).wait()
        mgr.wait()
    finally:
        _Unlisted.down = False


def test_a_refused_save_leaves_no_rewind_for_a_later_upload(tmp_path):
    """A save of a step already there, refused while the remote tier could not be listed, moves
    nothing: the next save's upload left this run's own remote steps 4 and 5 where they were."""
    with stashpoint.CheckpointManager(tmp_path / "nvme", keep_last=None, remote_root=_Unlisted(tmp_path / "r")) as mgr:
        for s in (1, 2, 3, 4, 5):
            mgr.save(s, _state(s)).wait()
        mgr.wait()
        _Unlisted.down = True
        try:
            with pytest.raises(stashpoint.CheckpointError, match="step 3 already has a committed checkpoint"):
                mgr.save(3, _state(33))
        finally:
            _Unlisted.down = False
        mgr.save(6, _state(6)).wait()
        mgr.wait()
        assert mgr.remote_steps() == [1, 2, 3, 4, 5, 6]
    assert not list((tmp_path / "r").glob("step-*.rewound-*"))


def test_a_damaged_step_right_above_the_one_restored_is_set_aside_not_deleted(tmp_path):
    """Before: damaged steps did not count for the run's highest, so saving K + 1 after
    ``restore(step=K)`` took it for a new step and deleted the old one's directory."""
    root = tmp_path / "run"
    with stashpoint.CheckpointManager(root, keep_last=None) as mgr:
        for s in range(1, 6):
            mgr.save(s, _state(s)).wait()
    manifest = root / "step-00000005" / "manifest.json"
    raw = bytearray(manifest.read_bytes())
    raw[40] ^= 1
    manifest.write_bytes(bytes(raw))
    with stashpoint.CheckpointManager(root, keep_last=None) as mgr:
        assert mgr.restore(_state(0), step=4) == 4
        mgr.save(5, _state(50)).wait()
        assert mgr.steps() == [1, 2, 3, 4, 5]
    assert _names(root, "rewound") == ["step-00000005"], "kept aside, for a person to look at"
    kept = next(root.glob("step-00000005.rewound-*")) / "manifest.json"
    assert kept.read_bytes() == bytes(raw)
    assert _resume(root, keep_last=None) == (5, 50.0)


class _Down:
    """The remote tier gone for real: its directory renamed away and a file in its place."""

    def __init__(self, remote: Path) -> None:
        self.remote, self.away = remote, remote.with_name(remote.name + ".away")

    def __enter__(self) -> None:
        self.remote.rename(self.away)
        self.remote.write_text("")

    def __exit__(self, *exc: object) -> None:
        self.remote.unlink()
        self.away.rename(self.remote)


def _first_run(local: Path, remote: Path) -> None:
    with stashpoint.CheckpointManager(local, keep_last=None, remote_root=remote) as mgr:
        for s in range(1, 7):
            mgr.save(s, _state(s)).wait()


def test_a_rewind_whose_first_upload_fails_is_moved_by_the_next_and_its_step_uploaded_after_it(tmp_path):
    """Before: the rewind went with the one upload of its save; that upload failing (the remote
    tier down for a moment), nobody moved the abandoned run's remote steps 4-6, a restart
    resumed its step 6, and the new run's step 4 was never uploaded (the remote tier had a 4).
    The failed step 4 goes up right after step 5's upload, which moved them."""
    local, remote = tmp_path / "nvme", tmp_path / "remote"
    _first_run(local, remote)
    with stashpoint.CheckpointManager(local, keep_last=None, remote_root=remote) as mgr:
        assert mgr.restore(_state(0), step=3) == 3
        with _Down(remote):
            mgr.save(4, _state(40)).wait()
            with pytest.raises(stashpoint.CheckpointError, match="uploading step 4"):
                mgr.wait()
        mgr.save(5, _state(50)).wait()
        mgr.wait()
        assert mgr.remote_steps() == [1, 2, 3, 4, 5]
    assert _names(remote, "rewound") == ["step-00000004", "step-00000005", "step-00000006"]
    assert _resume(local, keep_last=None, remote_root=remote) == (5, 50.0)
    assert _resume(tmp_path / "fresh-node", remote_root=remote) == (5, 50.0)
    out = _state(0)
    stashpoint.load(out, remote / "step-00000004")
    assert out["w"][0] == 40.0, "the new run's step 4"


def test_a_rewind_after_a_restore_that_could_not_see_the_remote_tier_is_kept_across_restarts(tmp_path):
    """Before: the remote tier was left alone when the restore could not list it, and the next
    restart resumed the abandoned run's step 6 from it."""
    local, remote = tmp_path / "nvme", tmp_path / "remote"
    _first_run(local, remote)
    with _Down(remote):
        mgr = stashpoint.CheckpointManager(local, keep_last=None, remote_root=remote)
        assert mgr.restore(_state(0), step=3) == 3 and mgr.restored_from() == "local"
        for s in (4, 5):
            mgr.save(s, _state(10 * s)).wait()
        with pytest.raises(stashpoint.CheckpointError, match="uploading step"):
            mgr.close()
    assert (local / ".stashpoint-rewind.json").exists(), "written down until the remote tier has seen it"
    assert _resume(local, keep_last=None, remote_root=remote) == (5, 50.0)  # its catch-up moves them
    assert not (local / ".stashpoint-rewind.json").exists()
    assert _names(remote, "rewound") == ["step-00000004", "step-00000005", "step-00000006"]
    assert _resume(tmp_path / "fresh-node", remote_root=remote) == (5, 50.0)
    assert stashpoint.verify(local).ok


_NOW = '"2999-01-01T00:00:00+00:00"'


@pytest.mark.parametrize(
    "planted",
    [
        b"",
        b"{not json",
        b'{"above": "3"}',
        b'{"above": 3.5}',
        b"\xff" * 300,
        b'{"above": 3}',  # no remote tier, no time
        b'{"above": -1, "remote": "R", "at": ' + _NOW.encode() + b"}",
        b'{"above": 3, "remote": "elsewhere", "at": ' + _NOW.encode() + b"}",
        b'{"above": 3, "remote": "R", "at": "2999-01-01T00:00:00"}',  # a time of no zone
        b"[" * 2000,  # nested past the parser's depth
    ],
)
def test_a_rewind_mark_that_is_no_mark_of_ours_is_ignored(tmp_path, planted):
    local, remote = tmp_path / "nvme", tmp_path / "remote"
    _first_run(local, remote)
    (local / ".stashpoint-rewind.json").write_bytes(planted.replace(b'"R"', f'"{remote}"'.encode()))
    assert _resume(tmp_path / "fresh", remote_root=remote) == (6, 6.0)
    assert _resume(local, keep_last=None, remote_root=remote) == (6, 6.0)
    assert stashpoint.verify(remote).ok and stashpoint.verify(local).ok


def test_a_rewind_mark_dated_in_the_future_is_ignored(tmp_path, caplog):
    local, remote = tmp_path / "nvme", tmp_path / "remote"
    _first_run(local, remote)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    mark = {"above": 0, "remote": str(remote), "at": "9999-12-31T00:00:00+00:00"}
    (fresh / ".stashpoint-rewind.json").write_text(json.dumps(mark))
    assert _resume(fresh, remote_root=remote) == (6, 6.0)
    assert "in the future; it is ignored" in caplog.text


def test_a_rewind_mark_never_takes_a_step_committed_after_it(tmp_path):
    """A mark that outlived its purpose (its removal failed; a job that came back to a root that
    held it): before, it moved the new run's remote steps aside and restores passed them by."""
    import json

    local, remote = tmp_path / "nvme", tmp_path / "remote"
    (local).mkdir()
    mark = {"above": 3, "remote": str(remote), "at": "2020-01-01T00:00:00+00:00"}
    (local / ".stashpoint-rewind.json").write_text(json.dumps(mark))
    _first_run(local, remote)  # steps 1-6, all committed after the mark
    assert _resume(tmp_path / "fresh", remote_root=remote) == (6, 6.0)
    assert _resume(local, keep_last=None, remote_root=remote) == (6, 6.0)
    assert _names(remote, "rewound") == []
    with stashpoint.CheckpointManager(local, keep_last=None, remote_root=remote) as mgr:
        assert mgr.remote_steps() == [1, 2, 3, 4, 5, 6]


def test_a_rewind_mark_that_could_not_be_removed_never_takes_the_new_runs_steps(tmp_path, monkeypatch):
    """The mark's removal fails once after its steps were moved. Before, the next upload applied
    it again and moved the new run's step 4 aside (committed in the same second as the mark)."""
    from stashpoint._core.naming import REWIND_NAME

    local, remote = tmp_path / "nvme", tmp_path / "remote"
    _first_run(local, remote)
    real = LocalStorage.delete
    refused = []

    def delete(self, name):
        if name == REWIND_NAME and not refused:
            refused.append(name)
            raise PermissionError(13, "Permission denied (injected once)", name)
        return real(self, name)

    with stashpoint.CheckpointManager(local, keep_last=None, remote_root=remote) as mgr:
        with _Down(remote):
            assert mgr.restore(_state(0), step=3) == 3
        monkeypatch.setattr(LocalStorage, "delete", delete)
        for s in (4, 5, 6):
            mgr.save(s, _state(10 * s)).wait()
            mgr.wait()
        assert refused and mgr.remote_steps() == [1, 2, 3, 4, 5, 6]
    assert not (local / REWIND_NAME).exists(), "removed by a later upload"
    assert _names(remote, "rewound") == ["step-00000004", "step-00000005", "step-00000006"]
    assert _resume(tmp_path / "fresh", remote_root=remote) == (6, 60.0)
    out = _state(0)
    stashpoint.load(out, remote / "step-00000004")
    assert out["w"][0] == 40.0


def test_a_rewind_mark_a_crash_left_half_written_is_removed_when_a_manager_opens(tmp_path):
    torn = tmp_path / f"..stashpoint-rewind.json.{'ab' * 16}.partial"
    other = tmp_path / ".notes.partial"  # not ours: kept
    torn.write_bytes(b'{"above": 3')
    other.write_bytes(b"x")
    with stashpoint.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.ones(2)}).wait()
    assert not torn.exists() and other.exists()


class _SlowUploads(LocalStorage):
    """A remote tier whose uploads (off the training thread) take a while."""

    def open_writer(self, name, size):  # type: ignore[no-untyped-def]
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.3)
        return super().open_writer(name, size)

    def child(self, name):  # type: ignore[no-untyped-def]
        return _SlowUploads(self.root / name)


def test_a_rewind_while_uploads_run_leaves_none_of_the_abandoned_steps_in_the_remote_tier(tmp_path):
    """Steps 4-6 were saved without their uploads (a crash before them): the next manager
    uploads them as it opens, and a rewind to step 2 comes while they run. Before: the remote
    tier was listed before those uploads ended, so the steps they landed stayed above the new
    run's, and a fresh node resumed the abandoned run."""
    nvme, remote = tmp_path / "nvme", tmp_path / "remote"
    with stashpoint.CheckpointManager(nvme, keep_last=None, remote_root=remote) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, _state(s))
    with stashpoint.CheckpointManager(nvme, keep_last=None) as mgr:  # no remote: their uploads never ran
        for s in (4, 5, 6):
            mgr.save(s, _state(s))
    with stashpoint.CheckpointManager(nvme, keep_last=None, remote_root=_SlowUploads(remote)) as mgr:
        assert mgr.restore(_state(0), step=2) == 2
        mgr.save(3, _state(3.5)).wait()
        mgr.wait()
        assert mgr.steps() == [1, 2, 3] and mgr.remote_steps() == [1, 2, 3]
    assert _resume(tmp_path / "fresh", remote_root=remote) == (3, 3.5)
