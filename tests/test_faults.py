"""Real storage failures: a full disk and a read-only filesystem (a small tmpfs mounted here)."""

from __future__ import annotations

import subprocess
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
