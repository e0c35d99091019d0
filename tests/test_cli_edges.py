"""The command line at its edges: Ctrl-C, a stdout that fails, paths that are no directory,
a step removed while it is checked, pickles that would run code. Real processes where a
signal or a file descriptor is what is tested."""

from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import stashpoint
from conftest import ROOT
from stashpoint._tools import checking
from test_cli import cli, one_line_error

SRC = str(ROOT / "src")


def _stashpoint(*args: object, **kw: object) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.Popen(
        [sys.executable, "-m", "stashpoint", *map(str, args)],
        env=env,
        text=True,
        **kw,  # type: ignore[call-overload]
    )


def _interrupt_when(proc: subprocess.Popen[str], ready: object, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready() and proc.poll() is None and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)


def _big_state(n: int = 12, mib: int = 16) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.randn(mib << 18) for i in range(n)}


def test_ctrl_c_ends_verify_with_130_not_the_1_that_says_it_found_damage(tmp_path: Path) -> None:
    stashpoint.save(_big_state(), tmp_path / "ck", max_shard_bytes=8 << 20)
    err = tmp_path / "err"
    with err.open("w") as e:
        proc = _stashpoint("verify", tmp_path / "ck", stdout=subprocess.PIPE, stderr=e)
        _interrupt_when(proc, lambda: "[1/" in err.read_text())
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err.read_text())
    assert "verify: interrupted" in err.read_text() and "Traceback" not in err.read_text()
    assert "FAILED" not in out and "[1/" not in out  # progress goes to stderr: stdout is the report


def test_ctrl_c_stops_an_import_uncommitted_and_says_so(tmp_path: Path) -> None:
    torch.save(_big_state(24), tmp_path / "big.pt")
    target = tmp_path / "imp"
    proc = _stashpoint("import", tmp_path / "big.pt", target, stderr=subprocess.PIPE, stdout=subprocess.PIPE)
    _interrupt_when(proc, lambda: target.is_dir() and any(target.iterdir()))
    _, err = proc.communicate(timeout=60)
    if "committed before it stopped" in err:  # the signal came after the commit (a fast disk): said so
        assert (target / "manifest.json").is_file()
    else:  # before: nothing committed, as said, and the exit hooks did not finish the save behind it
        assert f"interrupted; nothing was committed at {target}" in err, err
        time.sleep(1)
        assert not (target / "manifest.json").exists()
    assert proc.returncode == 130 and "Traceback" not in err and "Aborted" not in err, err
    again = cli(
        "import", tmp_path / "big.pt", target, *(["--overwrite"] if (target / "manifest.json").exists() else [])
    )
    assert again.exit_code == 0, again.stderr
    assert torch.equal(stashpoint.read(target)["w3"], torch.load(tmp_path / "big.pt")["w3"])


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here")
@pytest.mark.parametrize("command", ["verify", "inspect", "ls"])
def test_a_json_report_to_a_full_disk_is_one_line_and_exit_2(tmp_path: Path, command: str) -> None:
    """Before: two tracebacks (the error's own JSON written to the same failing stdout), exit 1."""
    mgr = stashpoint.CheckpointManager(tmp_path / "run")
    mgr.save(1, {"w": torch.ones(3)})
    mgr.close()
    path = tmp_path / "run" if command == "ls" else mgr.path(1)
    with open("/dev/full", "w") as full:
        proc = _stashpoint(command, "--json", path, stdout=full, stderr=subprocess.PIPE)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert err.count("\n") == 1 and "No space left on device" in err and "Traceback" not in err, err


def test_a_path_that_is_no_directory_is_no_checkpoint_exit_2(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    for path, kind in ((tmp_path / "fifo", "a FIFO"), ("/dev/null", "a special file"), (tmp_path / "a", "a loop")):
        for command in ("verify", "inspect"):
            one_line_error(cli(command, path), f"{path} is {kind}", "not a stashpoint checkpoint directory")
    with pytest.raises(stashpoint.CheckpointError, match="is a FIFO, not a stashpoint checkpoint directory"):
        stashpoint.load({"w": torch.zeros(1)}, tmp_path / "fifo")


def test_a_step_removed_while_it_is_checked_is_no_damage(tmp_path: Path) -> None:
    """A manager's retention deletes the step a verify is reading: before, "missing" problems
    and exit 1 (damage); now the step is said to be gone."""
    stashpoint.save(_big_state(4, 1), tmp_path / "ck", max_shard_bytes=1 << 20)

    def progress(message: str) -> None:
        if message.startswith("[1/"):
            shutil.rmtree(tmp_path / "ck")

    with pytest.raises(stashpoint.CheckpointNotFoundError, match="was removed while it was checked"):
        checking.verify(tmp_path / "ck", progress=progress)


def test_an_unreadable_run_directory_names_the_fix(tmp_path: Path) -> None:
    mgr = stashpoint.CheckpointManager(tmp_path / "run")
    mgr.save(1, {"w": torch.ones(3)})
    mgr.close()
    (tmp_path / "run").chmod(0)
    try:
        cmd = [sys.executable, "-m", "stashpoint", "ls", str(tmp_path / "run")]
        if os.geteuid() == 0:  # root reads it anyway: without the capabilities that let it
            if shutil.which("setpriv") is None:
                pytest.skip("root without setpriv: cannot make a directory unreadable")
            drop = "-dac_override,-dac_read_search"
            cmd = ["setpriv", "--bounding-set", drop, "--inh-caps", drop, *cmd]
        r = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": SRC}, capture_output=True, text=True, timeout=60)
    finally:
        (tmp_path / "run").chmod(0o755)
    assert r.returncode == 2 and "Permission denied (EACCES)" in r.stderr and "fix the cause" in r.stderr, r.stderr


class _System:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_calling_os_system_is_refused_for_what_it_asks_without_torchs_advice(tmp_path: Path) -> None:
    """torch 2.13 words a blocked module's global "unsupported GLOBAL ... whose module posix is
    blocked": before, the file was called unreadable (damaged) and torch's advice to load it
    with weights_only=False passed on."""
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "ran"
    torch.save({"w": torch.ones(3), "x": _System(marker)}, tmp_path / "evil.pt")
    r = cli("import", tmp_path / "evil.pt", tmp_path / "o1")
    one_line_error(r, "holds objects that torch.load(weights_only=True) refuses", "posix.system", "never runs code")
    dcp.save({"w": torch.ones(3), "x": _System(marker)}, checkpoint_id=str(tmp_path / "evil-dcp"), no_dist=True)
    r2 = cli("import", tmp_path / "evil-dcp", tmp_path / "o2")
    one_line_error(r2, "could not import the DCP checkpoint", "'x' holds objects", "posix.system")
    for out in (r.stderr, r2.stderr):
        assert "weights_only` set to `False`" not in out and "Re-running" not in out, out
    assert not marker.exists() and not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_a_damaged_value_in_a_dcp_checkpoint_is_damage_as_in_a_torch_save_file(tmp_path: Path) -> None:
    """Before, bytes no pickle at all in a DCP value were called objects torch refuses (with the
    advice to load the checkpoint with torch), where the same bytes in a torch.save file are damage."""
    import torch.distributed.checkpoint as dcp

    from stashpoint._tools.convert import import_checkpoint

    def damage(f: Path) -> None:
        data = bytearray(f.read_bytes())
        data[data.find(b"run-42") - 5] = 0xFF  # an opcode of the value's pickle
        f.write_bytes(bytes(data))

    state = {"w": torch.ones(3), "x": {"name": "run-42"}}
    torch.save(state, tmp_path / "t.pt")
    dcp.save(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    damage(tmp_path / "t.pt")
    damage(next((tmp_path / "ck").glob("*.distcp")))
    with pytest.raises(stashpoint.CorruptCheckpointError, match=r"not a readable torch\.save file"):
        import_checkpoint(tmp_path / "t.pt", tmp_path / "o1")
    with pytest.raises(stashpoint.CorruptCheckpointError, match=r"could not read the DCP .* 'x\.name' is not a"):
        import_checkpoint(tmp_path / "ck", tmp_path / "o2")


def test_dcp_metadata_of_a_torch_before_transform_descriptors_is_checked(tmp_path: Path, monkeypatch) -> None:
    """torch 2.6's _StorageInfo has no transform_descriptors, and a newer torch pickles it only
    when set: read back under 2.6 the attribute is missing (emulated: the class's default taken
    away, each place's attributes its own), and before, every DCP import failed on it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from stashpoint._tools import dcpread

    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    metadata = dcp.FileSystemReader(str(tmp_path / "ck")).read_metadata()
    monkeypatch.delattr(_StorageInfo, "transform_descriptors")
    for index, info in metadata.storage_data.items():
        old = object.__new__(_StorageInfo)
        old.__dict__.update(relative_path=info.relative_path, offset=info.offset, length=info.length)
        metadata.storage_data[index] = old
    dcpread._check_places(metadata, tmp_path / "ck")  # before: AttributeError


def test_the_writer_process_boot_takes_no_module_from_the_working_directory(tmp_path: Path) -> None:
    """Python 3.10 has no -P: a python -c puts the working directory first on sys.path, where
    a training directory's types.py would shadow the standard library's in the writer."""
    from stashpoint._save.writerchild import BOOT

    (tmp_path / "types.py").write_text("raise SystemExit('the working directory shadowed types')\n")
    boot = BOOT.split("pkg = ")[0] + "print(types.__file__)\n"  # its lines before the writer starts
    r = subprocess.run([sys.executable, "-c", boot], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and str(tmp_path) not in r.stdout, (r.stdout, r.stderr)


_INTERRUPTED_IMPORT = """
import sys, torch, stashpoint
from pathlib import Path
import stashpoint._tools.convert as convert
d, where = Path(sys.argv[1]), sys.argv[2]
torch.save({"w": torch.ones(4)}, d / "src.pt")
real = convert.save
def save(*args, **kwargs):  # Ctrl-C while the import's save runs: before its commit, or just after
    if where == "after":
        real(*args, **kwargs)
    raise KeyboardInterrupt
convert.save = save
from stashpoint._tools.cli import main
sys.argv = ["stashpoint", "import", str(d / "src.pt"), str(d / "out"), "--overwrite"]
main()
"""


@pytest.mark.parametrize("where", ["before", "after"])
def test_an_interrupted_import_over_a_checkpoint_says_whether_it_committed(tmp_path: Path, where: str) -> None:
    """Before: the old checkpoint's manifest, still there, was taken for the import's commit."""
    stashpoint.save({"old": torch.zeros(2)}, tmp_path / "out")
    r = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED_IMPORT, str(tmp_path), where],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": SRC},
    )
    assert r.returncode == 130, r.stderr
    held = set(stashpoint.read(tmp_path / "out"))
    if where == "before":
        assert f"nothing was committed at {tmp_path / 'out'}" in r.stderr and held == {"old"}, r.stderr
    else:
        assert f"{tmp_path / 'out'} was committed before it stopped" in r.stderr and held == {"w"}, r.stderr


def test_a_class_torch_refuses_is_named_without_torchs_preamble(tmp_path: Path) -> None:
    """torch 2.13 opens its refusal with how to load the file anyway, in terminal escapes."""
    torch.save({"w": torch.ones(2), "q": collections.deque([1])}, tmp_path / "deque.pt")
    r = cli("import", tmp_path / "deque.pt", tmp_path / "o")
    one_line_error(r, "(Unsupported global: GLOBAL collections.deque was not an allowed global by default)")
    assert "\\x1b" not in r.stderr and "can still be loaded" not in r.stderr, r.stderr
