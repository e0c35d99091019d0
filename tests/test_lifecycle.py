"""Saves meeting the rest of a program's life: a Ctrl-C while a manager closes or a blocking
save waits, a fork while a save is written (DataLoader workers), a shutdown that waits long,
and a manager dropped without close(). Real signals and real forks, in fresh processes."""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

import stashpoint
from conftest import ROOT

WORKER = Path(__file__).with_name("lifecycle_worker.py")
pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform != "linux", reason="fork, /proc")


def _run(case: str, root: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, str(WORKER), case, str(root)], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return {**json.loads(res.stdout.strip().splitlines()[-1]), "log": res.stderr}


def test_a_ctrl_c_while_a_manager_closes_keeps_the_root_until_its_saves_end(tmp_path):
    """Before: close() released the root's lock though its save went on; a manager opened then
    took the step being written for a leftover and removed it, and the save failed committing."""
    out = _run("close_interrupted", tmp_path / "run")
    assert out["interrupted"], out
    assert "already owns" in out["second"], out  # refused while the save is written
    assert "close() of the CheckpointManager" in out["log"] and "call close() again" in out["log"]
    assert out["steps"] == [1, 2], out
    assert "never committed" not in out["log"], out["log"]


def test_a_ctrl_c_in_a_blocking_save_says_the_save_goes_on(tmp_path):
    out = _run("save_interrupted", tmp_path)
    assert out["interrupted"] and out["committed"], out
    assert "goes on in the background and commits" in out["log"], out["log"]


def test_a_child_forked_while_a_save_is_written_neither_waits_for_it_nor_holds_its_files(tmp_path):
    """Before: the child's manager wait() and close() (the end of a with block) and the handle's
    wait() never returned, its save() wrote into the parent's root without the root's lock, and
    it held the shard being written open: the disk space of the step the retention deleted
    stayed in use as long as the child (a persistent DataLoader worker) lived."""
    out = _run("forked", tmp_path / "run")
    child = out["child"]
    assert "runs in process" in child["handle_wait"] and "cannot be waited for here" in child["handle_wait"], child
    for what in ("mgr_wait", "mgr_save"):
        assert "which this process was forked from" in child[what], child
    assert child["close_s"] < 1.0, child
    assert not [p for p in out["held"] if "step-" in p], out  # step 1's files, deleted by keep_last=1
    assert out["exit"] == 0 and [s for s in out["steps"] if "step" in s] == ["step-00000003"], out


def test_a_shutdown_waiting_long_for_saves_says_so(tmp_path, monkeypatch, caplog):
    from stashpoint._save import engine

    real = os.fsync
    monkeypatch.setattr(engine, "SAY_AFTER_S", 0.05)
    monkeypatch.setattr(os, "fsync", lambda fd: (__import__("time").sleep(0.3), real(fd))[1])
    handle = stashpoint.async_save({"w": torch.ones(1 << 16)}, tmp_path / "ck")
    with caplog.at_level(logging.WARNING, logger="stashpoint"):
        stashpoint.shutdown()
    assert handle.done() and handle.exception() is None
    assert any("waits for 1 save(s) still being written" in r.getMessage() for r in caplog.records), caplog.text


def test_a_manager_dropped_while_its_upload_runs_keeps_its_root_until_the_upload_ends(tmp_path, monkeypatch):
    """Before (with the cycle through the upload callback made weak): the root was freed
    mid-upload, and the next manager removed the remote step being uploaded as a leftover."""
    import threading

    from stashpoint._manager import uploader

    started, go = threading.Event(), threading.Event()
    real = uploader.copy_file

    def slow_copy(*args, **kwargs):
        started.set()
        go.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(uploader, "copy_file", slow_copy)
    options = {"remote_root": tmp_path / "remote"}
    mgr = stashpoint.CheckpointManager(tmp_path / "run", **options)
    mgr.save(1, {"w": torch.ones(4)}).wait()
    assert started.wait(30)
    dropped = weakref.ref(mgr)
    del mgr
    with pytest.raises(stashpoint.CheckpointError, match=r"already owns"):
        stashpoint.CheckpointManager(tmp_path / "run", **options)
    go.set()
    for _ in range(300):
        if dropped() is None:
            break
        __import__("time").sleep(0.1)
    assert dropped() is None  # the upload ended: nothing holds it, no cyclic collection needed
    with stashpoint.CheckpointManager(tmp_path / "run", **options) as again:
        assert again.steps() == [1]
    assert (tmp_path / "remote" / "step-00000001" / "manifest.json").exists()


@pytest.mark.parametrize("remote", [False, True])
def test_a_manager_dropped_without_close_frees_its_root_at_once(tmp_path, remote):
    """Before: a reference cycle kept it (and its root's lock) until the cyclic collector ran."""
    options = {"remote_root": tmp_path / "remote"} if remote else {}
    mgr = stashpoint.CheckpointManager(tmp_path / "run", **options)
    mgr.save(1, {"w": torch.ones(4)}).wait()
    mgr.wait()
    dropped = weakref.ref(mgr)
    gc.disable()
    try:
        del mgr
        assert dropped() is None
        stashpoint.CheckpointManager(tmp_path / "run", **options).close()
    finally:
        gc.enable()


def test_a_child_forked_while_a_checkpoint_file_is_read_does_not_hold_it(tmp_path):
    """An upload or a load reads a step's files: a child forked meanwhile closes its copies too
    (a review of the writes' fix found the reads' left open)."""
    from stashpoint._storage import LocalStorage

    # no page-cache hints after the save: their thread's descriptor, opened as the fork comes, is
    # not noted yet (a window of one system call, left open)
    stashpoint.save({"w": torch.ones(1 << 10)}, LocalStorage(tmp_path / "ck", cache_newest=False))
    storage = LocalStorage(tmp_path / "ck").shared_reads()  # one descriptor for the whole file
    name = next(n for n in storage.list() if n.startswith("shard-"))
    with storage.reading(name):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report through the pipe only
            held = []
            for fd in os.listdir("/proc/self/fd"):
                try:
                    held.append(os.readlink(f"/proc/self/fd/{fd}"))
                except OSError:
                    pass
            os.write(w, json.dumps(held).encode())
            os._exit(0)
        os.close(w)
        held = json.loads(os.fdopen(r).read())
        os.waitpid(pid, 0)
    assert not [p for p in held if name in p], held
