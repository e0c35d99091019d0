"""`stashpoint demo` and the command-line entry points."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from click.testing import CliRunner

from stashpoint._tools.cli import main
from stashpoint._tools.demo import LOG_KILLED, LOG_RESUMED, latest_committed, list_checkpoints, prepare_dir, read_log


def test_quick_demo_resumes_bitwise_identically(tmp_path: Path) -> None:
    demo_dir = tmp_path / "demo"
    # leftovers of an earlier demo run are cleared, not mistaken for this run's checkpoints
    (demo_dir / "step-00009999").mkdir(parents=True)
    (demo_dir / LOG_KILLED).write_text('{"step": 1, "loss": "0x1.0p+0"}\n')

    proc = subprocess.run(
        [sys.executable, "-m", "stashpoint", "demo", "--quick", "--dir", str(demo_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{proc.stderr}"
    assert "bitwise identical: yes" in out
    assert "SIGKILL at step" in out
    assert "torch.save+fsync" in out
    assert "stashpoint blocked" in out

    assert not (demo_dir / "step-00009999").exists()
    latest = latest_committed(demo_dir)
    assert latest is not None
    killed, resumed = read_log(demo_dir / LOG_KILLED), read_log(demo_dir / LOG_RESUMED)
    overlap = set(killed) & set(resumed)
    assert overlap
    assert all(killed[s] == resumed[s] for s in overlap)
    assert min(resumed) > 1  # the second run resumed from a checkpoint, it did not start over
    records = [json.loads(line) for line in (demo_dir / LOG_KILLED).read_text().splitlines() if line]
    assert any(r.get("event") == "checkpoint" and r["blocking_ms"] > 0 for r in records)


def _console_script() -> Path | None:
    name = "stashpoint.exe" if sys.platform == "win32" else "stashpoint"
    candidates = [Path(sysconfig.get_path("scripts")) / name, Path(sys.executable).parent / name]
    found = shutil.which("stashpoint")
    if found:
        candidates.append(Path(found))
    return next((c for c in candidates if c.exists()), None)


def test_console_script_entry_point() -> None:
    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "stashpoint"]
    assert ep.value == "stashpoint._tools.cli:main"
    script = _console_script()
    if script is None:
        pytest.skip("the stashpoint console script is not installed in this environment")
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "demo" in proc.stdout


def test_python_m_stashpoint_help() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "stashpoint", "demo", "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "--quick" in proc.stdout
    assert "--every" in proc.stdout


def test_demo_refuses_a_directory_it_did_not_make(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("important\n")
    result = CliRunner().invoke(main, ["demo", "--quick", "--dir", str(tmp_path)])
    assert result.exit_code != 0
    assert "does not look like a stashpoint demo directory" in result.output
    assert (tmp_path / "train.py").read_text() == "important\n"


def test_prepare_dir_clears_only_demo_leftovers(tmp_path: Path) -> None:
    d = tmp_path / "d"
    prepare_dir(d)  # created
    assert d.is_dir()
    (d / "step-00000010").mkdir()
    (d / "step-00000010" / "shard.safetensors").write_bytes(b"x")
    (d / LOG_RESUMED).write_text("")
    prepare_dir(d)
    assert list(d.iterdir()) == []
    (d / "step-10").mkdir()  # not the demo's naming
    with pytest.raises(ValueError, match="step-10"):
        prepare_dir(d)
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ValueError, match="is a file"):
        prepare_dir(f)


def test_a_training_runs_directory_is_never_taken_for_an_earlier_demo(tmp_path: Path) -> None:
    """A CheckpointManager's run directory holds step-* and the lock, as a demo's does. Before:
    `stashpoint demo --dir RUN` deleted its checkpoints, a live run's too."""
    import torch

    import stashpoint

    run = tmp_path / "prod"
    with stashpoint.CheckpointManager(run) as mgr:
        for step in (1000, 2000):
            mgr.save(step, {"w": torch.ones(4)})
        with pytest.raises(ValueError, match="no log of an earlier demo"):  # live
            prepare_dir(run)
    with pytest.raises(ValueError, match="no log of an earlier demo"):
        prepare_dir(run)
    (run / LOG_KILLED).write_text("")  # as if a demo had run there: still in use while a manager holds it
    with stashpoint.CheckpointManager(run), pytest.raises(ValueError, match="is in use"):
        prepare_dir(run)
    assert stashpoint.CheckpointManager(run).steps() == [1000, 2000]


def test_latest_committed_ignores_checkpoints_without_manifest(tmp_path: Path) -> None:
    for step, committed in ((10, True), (20, True), (30, False)):
        p = tmp_path / f"step-{step:08d}"
        p.mkdir()
        if committed:
            (p / "manifest.json").write_text("{}")
    (tmp_path / "step-00000040").write_text("a file, not a checkpoint")
    assert [(s, ok) for s, _, ok in list_checkpoints(tmp_path)] == [(10, True), (20, True), (30, False)]
    latest = latest_committed(tmp_path)
    assert latest is not None
    assert latest[0] == 20
