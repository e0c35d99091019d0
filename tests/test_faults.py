"""Real storage failures: a full disk and a read-only filesystem (a small tmpfs mounted here)."""

from __future__ import annotations

import subprocess
import time
import uuid
from pathlib import Path

import pytest
import torch

import stashpoint


@pytest.fixture
def small_fs(tmp_path):
    """A 12 MiB tmpfs; skipped where this process may not mount (the test needs root)."""
    mnt = tmp_path / f"fs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12M", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); the fault-injecting backend tests cover this")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _state(mb: int, v: float) -> dict:
    return {"w": torch.full((mb * 1024 * 1024 // 4,), v), "step": int(v)}


def test_a_full_disk_fails_the_save_cleanly_and_keeps_the_previous_checkpoint(small_fs: Path):
    stashpoint.save(_state(4, 1.0), small_fs / "a")
    h = stashpoint.async_save(_state(9, 2.0), small_fs / "b")  # does not fit beside "a"
    with pytest.raises(
        stashpoint.CheckpointError, match=r"saving the checkpoint to .*b failed: OSError.*No space left"
    ):
        h.wait()
    assert not (small_fs / "b" / "manifest.json").exists()
    assert list((small_fs / "b").glob("shard-*")) == [], "partial files are removed"
    out = _state(4, 0.0)
    stashpoint.load(out, small_fs / "a")
    assert out["w"][0] == 1.0 and out["step"] == 1
    stashpoint.save(_state(4, 3.0), small_fs / "c")  # space is back for a save that fits: it works


def test_a_read_only_filesystem_fails_the_save_with_a_clear_error(small_fs: Path):
    stashpoint.save(_state(1, 1.0), small_fs / "a")
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    try:
        with pytest.raises(stashpoint.CheckpointError, match=r"Read-only file system"):
            stashpoint.save(_state(1, 2.0), small_fs / "b")
        out = _state(1, 0.0)
        stashpoint.load(out, small_fs / "a")  # loading still works
        assert out["w"][0] == 1.0
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=True)


def test_failed_saves_a_manager_keeps_for_wait_do_not_keep_their_states_alive(small_fs: Path):
    """A disk that stays full, a manager whose failed handles wait for wait(): each handle's error
    used to hold its save's tree, layout (the state's tensors) and staging buffers."""
    import gc
    import weakref

    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * (11 << 20))  # about 1 MiB left: every 4 MiB save fails
    alive = []
    with stashpoint.CheckpointManager(small_fs / "run") as manager:
        for step in range(4):
            state = _state(4, float(step))  # a fresh state every time, as a new model would be
            alive.append(weakref.ref(state["w"]))
            manager.save(step, state)
            del state
            deadline = time.monotonic() + 30
            while not all(a.done() for _, a in manager._handles) and time.monotonic() < deadline:
                time.sleep(0.01)
        gc.collect()
        assert len(manager._handles) == 4, "failed saves are kept until wait() reports them"
        kept = sum(r() is not None for r in alive)
        assert kept == 0, f"{kept} of 4 failed saves' states are still alive"
        with pytest.raises(stashpoint.CheckpointError, match="No space left"):
            manager.wait()
        filler.unlink()


def test_a_managers_save_to_a_read_only_root_fails_through_its_handle_and_training_goes_on(small_fs: Path):
    """Before: the clean-up of the step's missing directory (an unlink, which a read-only file
    system answers with EROFS, not ENOENT) raised from maybe_save, into the training loop,
    saying it could not tell what the step held."""
    view = small_fs / "view"
    (small_fs / "empty" / "run").mkdir(parents=True)
    with stashpoint.CheckpointManager(view / "run", every_steps=1) as manager:
        manager.maybe_save(1, _state(1, 1.0)).wait()
        # the run's directory turns read-only (an empty read-only mount over it: the manager's
        # open lock file stays on the file system below, which could not be remounted)
        subprocess.run(["mount", "--bind", str(small_fs / "empty"), str(view)], check=True)
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True)
            handle = manager.maybe_save(2, _state(1, 2.0))  # returns: training goes on
            with pytest.raises(stashpoint.CheckpointError, match=r"cannot create .* Read-only file system"):
                handle.wait()
        finally:
            subprocess.run(["umount", "-l", str(view)], check=True)
        manager.maybe_save(3, _state(1, 3.0)).wait()
        assert manager.steps() == [1, 3]


def test_a_failed_saves_handle_keeps_no_staging_memory_past_shutdown(small_fs: Path):
    """A handle (or its error) kept for a report held the save's job through its error's
    frames, and with it the engine's staging pool: after shutdown() the next save allocated a
    second one (staging memory doubled)."""
    import gc
    import weakref

    from stashpoint._save.engine import current_engine

    (small_fs / "filler").write_bytes(b"\0" * (11 << 20))  # about 1 MiB left: a 4 MiB save fails
    handle = stashpoint.async_save(_state(4, 1.0), small_fs / "ck")
    with pytest.raises(stashpoint.CheckpointError, match="No space left"):
        handle.wait()
    engine = current_engine()
    assert engine is not None
    pool = weakref.ref(engine.pool)
    del engine
    stashpoint.shutdown()
    gc.collect()
    assert pool() is None, "the failed save's handle keeps the staging pool alive"
    assert handle.exception() is not None  # the handle and its error are still held here


def test_a_failure_its_handle_raised_is_not_raised_again_by_the_managers_wait(small_fs: Path):
    """A training loop that caught a save's failure from ``handle.wait()`` and went on must not get
    it again from ``close()`` at the end of training; a failure nobody looked at still is."""
    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * (11 << 20))  # about 1 MiB left: a 4 MiB save fails
    manager = stashpoint.CheckpointManager(small_fs / "run")
    seen = manager.save(1, _state(4, 1.0))
    with pytest.raises(stashpoint.CheckpointError, match="No space left"):
        seen.wait()
    manager.wait()  # reported already: not raised again
    unseen = manager.save(2, _state(4, 2.0))
    while not unseen.done():
        time.sleep(0.01)
    with pytest.raises(stashpoint.CheckpointError, match="No space left"):
        manager.wait()
    filler.unlink()
    manager.save(3, _state(4, 3.0)).wait()
    manager.close()
    assert stashpoint.CheckpointManager(small_fs / "run").steps() == [3]


def test_a_file_size_limit_names_the_shard_and_the_bytes_it_refused(tmp_path: Path):
    """Before: "OSError: [Errno 27] File too large", naming no file and no size (the space is
    reserved with posix_fallocate, whose error names nothing)."""
    import resource

    stashpoint.save(_state(4, 0.0), tmp_path / "first")  # its staging memory (a memory file) made under no limit
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # Python ignores SIGXFSZ: writes fail with EFBIG
    try:
        with pytest.raises(stashpoint.CheckpointError) as e:
            stashpoint.save(_state(4, 1.0), tmp_path / "ck")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    msg = str(e.value)
    assert "File too large (reserving 4,1" in msg and str(tmp_path / "ck") in msg and "shard-" in msg, msg
    stashpoint.save(_state(4, 1.0), tmp_path / "ck")  # the limit gone, the same path saves


def test_a_sync_failing_after_the_commit_says_the_checkpoint_loads_but_may_not_be_durable(tmp_path, monkeypatch):
    """Before, in one process: "rank 0: ... confirming it across the ranks failed ...; it is
    complete and loadable" (no ranks confirm anything there, and nothing said durability failed)."""
    from stashpoint._storage import local

    real = local.fsync_dir

    def failing(path):  # the run directory's sync after the manifest's link fails
        if (Path(path) / "manifest.json").exists():
            raise OSError(5, "Input/output error")
        real(path)

    monkeypatch.setattr(local, "fsync_dir", failing)
    with pytest.raises(stashpoint.CheckpointError) as e:
        stashpoint.save(_state(1, 1.0), tmp_path / "ck")
    msg = str(e.value)
    assert "was committed" in msg and "may not survive a power loss" in msg and "rank" not in msg, msg
    monkeypatch.setattr(local, "fsync_dir", real)
    out = _state(1, 0.0)
    stashpoint.load(out, tmp_path / "ck")
    assert out["w"][0] == 1.0


def test_a_run_that_finds_no_room_for_the_next_step_says_how_much_it_needs(small_fs: Path, caplog):
    """Before: "No space left on device ... fix the cause and save again", with nothing on why a
    disk that holds keep_last steps cannot take the next (it is written before the oldest goes)."""
    with stashpoint.CheckpointManager(small_fs / "run", keep_last=2) as manager:
        for step in (1, 2):
            manager.save(step, _state(4, float(step))).wait()
        with pytest.raises(stashpoint.CheckpointError, match="No space left"):
            manager.save(3, _state(4, 3.0)).wait()
    assert "this run keeps 2 step(s) and writes the next beside them" in caplog.text, caplog.text
    assert "needs room for 3 steps of about 0.0042 GB" in caplog.text, caplog.text
