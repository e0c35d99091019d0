"""stashpoint.shutdown(): one owner of the process-wide state, closed in order, so that programs
end normally; a forked child starts with none of its parent's threads, sockets or groups."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import stashpoint
from conftest import run_python
from dist_util import run_world
from stashpoint import _runtime
from stashpoint._save import writerproc

WORKER = Path(__file__).with_name("shutdown_worker.py")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_shutdown_waits_for_saves_stops_the_writer_process_and_stashpoint_starts_afresh(tmp_path):
    state = {"w": torch.randn(1 << 20)}
    stashpoint.save(state, tmp_path / "first", writer="process")
    pid = writerproc.current_pid()
    assert pid is not None and _runtime.peek("save.engine") is not None
    handle = stashpoint.async_save(state, tmp_path / "a", writer="process")
    stashpoint.shutdown()
    assert handle.done() and handle.exception() is None  # waited for, not abandoned
    assert writerproc.current_pid() is None and not _alive(pid)
    assert _runtime.peek("save.engine") is None and _runtime.peek("save.writer_process") is None
    stashpoint.shutdown()  # twice is harmless
    stashpoint.save(state, tmp_path / "b", writer="process")  # used again: everything made anew
    assert writerproc.current_pid() not in (None, pid)
    out = {"w": torch.zeros(1 << 20)}
    stashpoint.load(out, tmp_path / "a")
    assert torch.equal(out["w"], state["w"])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("then", ["ends", "raises"])
def test_a_program_ending_right_after_async_save_commits_it_written_in_several_files(tmp_path, then):
    """Before: with more than one shard file, the save's writes started after the interpreter
    had closed its thread pools ("cannot schedule new futures after interpreter shutdown"):
    nothing was committed and the only trace was a log line."""
    code = f"""
import torch, stashpoint
state = {{"a": torch.arange(1 << 20, dtype=torch.float32), "b": torch.ones(1 << 20)}}
stashpoint.async_save(state, {str(tmp_path / "ck")!r}, max_shard_bytes=4 << 20)
if {then == "raises"}:
    raise RuntimeError("the training failed")
"""
    run_python(code)
    back = stashpoint.read(tmp_path / "ck")
    assert torch.equal(back["a"], torch.arange(1 << 20, dtype=torch.float32))
    assert torch.equal(back["b"], torch.ones(1 << 20))
    assert len(list((tmp_path / "ck").glob("shard-*"))) == 2


def test_a_forked_child_starts_without_the_parents_state_and_can_save(tmp_path):
    stashpoint.save({"w": torch.ones(8)}, tmp_path / "parent", writer="process")
    parent_writer = writerproc.current_pid()
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code only
        ok = _runtime.peek("save.engine") is None and writerproc.current_pid() is None
        try:
            stashpoint.save({"w": torch.ones(8)}, tmp_path / "child")
        except Exception:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert writerproc.current_pid() == parent_writer  # the parent's writer process is untouched
    assert (tmp_path / "child" / "manifest.json").exists()


@pytest.mark.slow  # ~50 s of two ranks; the single-process shutdown tests stay in the default tier
def test_two_ranks_end_normally_after_shutdown_without_os_exit(tmp_path):
    """shutdown() waits for the save still persisting, then destroys stashpoint's gloo group once
    both ranks reach it; the worker returns from main (no os._exit) and exits 0, three runs in a row.
    Saves and loads after a shutdown work (before: refused, torch naming a new group over the
    same ranks as the destroyed one)."""
    for i in range(3):
        results = run_world(2, str(tmp_path / str(i)), worker=WORKER, timeout=120)
        assert [r["rank"] for r in results] == [0, 1]
        assert all(r["last_done"] for r in results)
        assert all(r["again"] == [[1.0] * 4, [2.0] * 4] for r in results), results
        assert (tmp_path / str(i) / "c" / "manifest.json").exists()
