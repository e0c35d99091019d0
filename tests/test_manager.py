"""CheckpointManager: listing, retention, backpressure, crash recovery, memory bound, resume."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import stashpoint
import stashpoint._storage.local
from stashpoint._core.naming import step_dir, written_by_a_save
from stashpoint._save.engine import get_engine
from stashpoint.errors import CheckpointError

ROOT = Path(__file__).resolve().parents[1]
CHILD = Path(__file__).with_name("manager_child.py")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def _script(script: str, *args: object, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``script`` run by a fresh interpreter with ``args``, its output captured."""
    return subprocess.run(
        [sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=_env()
    )


def _state(v: float = 0.0) -> dict:
    return {"w": torch.full((1000,), float(v)), "step": 0}


def test_save_restore_and_listing(tmp_path):
    with stashpoint.CheckpointManager(tmp_path / "run", keep_last=None) as mgr:
        assert mgr.latest_step() is None and mgr.steps() == []
        assert mgr.restore(_state()) is None, "a fresh root restores nothing"
        for step in (5, 10, 15):
            s = _state(step)
            s["step"] = step
            h = mgr.save(step, s)
            assert h.wait().step == step
        assert mgr.steps() == [5, 10, 15] and mgr.latest_step() == 15
        assert sorted(p.name for p in (tmp_path / "run").glob("step-*")) == [
            "step-00000005",
            "step-00000010",
            "step-00000015",
        ]
        target = _state()
        assert mgr.restore(target) == 15 and target["step"] == 15 and target["w"][0] == 15
        with pytest.raises(stashpoint.CheckpointError, match="step 10 already has a committed checkpoint"):
            mgr.save(10, _state())
        assert mgr.restore(target, step=5) == 5 and target["w"][0] == 5  # a save now would go back (test_rewind)
        assert [s.step for s in mgr.history] == [5, 10, 15]


def test_retention_keep_last_every_and_best(tmp_path):
    losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 3.0, 5: 2.5, 6: 6.0, 7: 7.0, 8: 8.0}
    with stashpoint.CheckpointManager(tmp_path / "r", keep_last=2, keep_every=4, keep_best=(1, "loss")) as mgr:
        for step, loss in losses.items():
            mgr.save(step, _state(step), metrics={"loss": loss})
            mgr.wait()
        # last 2: 7, 8; every 4th: 4, 8; best loss: 2
        assert mgr.steps() == [2, 4, 7, 8]
    # a new manager reads the metrics back from the manifests
    with stashpoint.CheckpointManager(tmp_path / "r", keep_last=1, keep_best=(1, "loss", "max")) as mgr:
        mgr.save(9, _state(9), metrics={"loss": 0.5})
        mgr.wait()
        assert mgr.steps() == [8, 9], "max mode keeps the highest loss (8.0) and the newest"


@pytest.mark.parametrize("node_local", [False, True])
@pytest.mark.parametrize("planted", ["fifo", "garbage"])
def test_a_damaged_step_numbered_above_the_rest_costs_retention_no_real_step(tmp_path, node_local, planted):
    """Before: a step directory numbered 97 whose manifest was damaged (or a FIFO) counted as
    the newest step, so keep_last=1 deleted each real step right after its commit, and a
    restart found nothing to restore. A save below it sets it aside, as it does any step of
    the run it goes back from, never deletes it."""
    root = tmp_path / "r"
    with stashpoint.CheckpointManager(root, keep_last=1, node_local=node_local) as mgr:
        mgr.save(1, _state(1)).wait()
    (root / "step-00000097").mkdir()
    manifest = root / "step-00000097" / "manifest.json"
    os.mkfifo(manifest) if planted == "fifo" else manifest.write_bytes(b'{"format": "stashpoint", ')
    with stashpoint.CheckpointManager(root, keep_last=1, node_local=node_local) as mgr:
        for step in (2, 3):
            mgr.save(step, _state(step))
            mgr.wait()  # retention too
        assert mgr.steps() == [3], "step 3 is the last"
    assert [p.name.split(".")[1].split("-")[0] for p in root.glob("step-00000097.*")] == ["rewound"], "kept aside"
    state = _state(0)
    with stashpoint.CheckpointManager(root, keep_last=1, node_local=node_local) as mgr:
        assert mgr.restore(state) == 3
        assert torch.equal(state["w"], _state(3)["w"])
        # a damaged step below the newest whole one goes as any other the rules do not keep
        (root / "step-00000002").mkdir()
        (root / "step-00000002" / "manifest.json").write_bytes(b"{")
        mgr.save(4, _state(4))
        mgr.wait()
        assert 2 not in mgr.steps() and 4 in mgr.steps()


def test_any_integer_step_is_a_step_and_a_closed_manager_refuses_every_use(tmp_path):
    import numpy as np

    mgr = stashpoint.CheckpointManager(tmp_path / "r")
    with mgr:
        mgr.save(np.int64(3), _state(3)).wait()
        assert mgr.restore(_state(), step=np.int32(3)) == 3
        for bad in (True, 2.0, -1, "4"):
            with pytest.raises(ValueError, match="step must be a non-negative integer"):
                mgr.save(bad, _state())
    for use in (lambda: mgr.save(4, _state()), lambda: mgr.restore(_state()), lambda: mgr.__enter__()):
        with pytest.raises(stashpoint.CheckpointError, match="is closed; create a new one"):
            use()


def test_a_checkpoint_is_not_saved_into_a_managers_run_directory(tmp_path):
    """Before: save() and import wrote a checkpoint among the manager's steps; ls then called
    the directory a checkpoint and verify offered to delete the manager's lock file."""
    with stashpoint.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, _state(1)).wait()
        with pytest.raises(stashpoint.CheckpointError, match="is a CheckpointManager's run directory"):
            stashpoint.save(_state(2), tmp_path / "run")
    with pytest.raises(stashpoint.CheckpointError, match="is a CheckpointManager's run directory"):
        stashpoint.save(_state(2), tmp_path / "run")  # closed: its steps still say what it is
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".stashpoint-manager.lock", "step-00000001"]


def test_second_manager_on_the_same_root_is_refused(tmp_path):
    with (
        stashpoint.CheckpointManager(tmp_path / "r"),
        pytest.raises(stashpoint.CheckpointError, match=r"another CheckpointManager .* already owns"),
    ):
        stashpoint.CheckpointManager(tmp_path / "r")
    stashpoint.CheckpointManager(tmp_path / "r").close()  # released on close


def test_a_child_forked_while_the_manager_is_open_does_not_keep_the_root_locked(tmp_path):
    """A flock belongs to the open file, which a fork shares (DataLoader workers): the child
    must not hold the root after the parent's manager closed."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    mgr = stashpoint.CheckpointManager(tmp_path / "r")
    started, stop = ctx.Event(), ctx.Event()

    def worker() -> None:
        started.set()
        stop.wait(60)

    child = ctx.Process(target=worker)
    child.start()
    try:
        assert started.wait(30)  # the child runs: its copy of the lock is closed by now
        mgr.close()
        assert child.is_alive()
        stashpoint.CheckpointManager(tmp_path / "r").close()  # refused before: the child held the lock
    finally:
        stop.set()
        child.join(30)
    assert child.exitcode == 0


def test_a_file_system_that_cannot_lock_is_named_with_the_fix(tmp_path, monkeypatch):
    import errno
    import fcntl

    from stashpoint._manager import lock

    opened: list[int] = []
    real_open = os.open

    def tracked_open(*args, **kwargs):
        fd = real_open(*args, **kwargs)
        opened.append(fd)
        return fd

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(lock.os, "open", tracked_open)
    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(stashpoint.CheckpointError, match=r"cannot lock .*No locks available.*mount it with locking"):
        stashpoint.CheckpointManager(tmp_path / "r")
    assert opened and all(not _is_open(fd) for fd in opened), "the lock file's descriptor is closed"


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_leftovers_of_a_crashed_save_are_removed_and_committed_steps_kept(tmp_path, caplog):
    with stashpoint.CheckpointManager(tmp_path / "r") as mgr:
        mgr.save(1, _state(1)).wait()
    partial = tmp_path / "r" / "step-00000002"
    partial.mkdir()
    (partial / "shard-r00000-0000-abcd.safetensors").write_bytes(b"half")
    (tmp_path / "r" / "notes.txt").write_text("user file")
    with caplog.at_level(logging.WARNING, logger="stashpoint"), stashpoint.CheckpointManager(tmp_path / "r") as mgr:
        assert mgr.steps() == [1]
    assert not partial.exists() and (tmp_path / "r" / "notes.txt").exists()
    assert "never committed" in caplog.text


def test_a_step_directory_holding_a_users_files_is_never_deleted(tmp_path, caplog):
    """An older run's ``step-00000500/model.pt`` (no manifest) is not a crashed save's leftover:
    the manager's clean-up leaves it, and a save of that step is refused naming the file."""
    run = tmp_path / "r"
    old = run / "step-00000500"
    (old / "g00000").mkdir(parents=True)
    (old / "model.pt").write_bytes(b"weights")
    (old / "shard-r00000-0000-abcd.safetensors").write_bytes(b"half")  # beside ours, still kept
    partial = run / "step-00000002"
    (partial / "g00000").mkdir(parents=True)  # ours only: a group directory, a write a crash left
    (partial / "g00000" / "index-r00000-abcd.json").write_bytes(b"{")
    (partial / ".manifest.json.0123456789abcdef0123456789abcdef.partial").write_bytes(b"{")
    with caplog.at_level(logging.WARNING, logger="stashpoint"), stashpoint.CheckpointManager(run) as mgr:
        assert mgr.steps() == []
        assert (old / "model.pt").read_bytes() == b"weights" and not partial.exists()
        assert "'model.pt'" in caplog.text and "did not write" in caplog.text
        with pytest.raises(CheckpointError, match=r"model\.pt.*did not write"):
            mgr.save(500, _state(1))
        mgr.save(501, _state(1)).wait()
    assert (old / "model.pt").read_bytes() == b"weights"


def test_saves_of_new_steps_warn_of_nothing(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="stashpoint"), stashpoint.CheckpointManager(tmp_path / "r") as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step)).wait()
    assert caplog.text == "", caplog.text


def test_a_manager_given_a_checkpoint_instead_of_its_run_directory_says_so(tmp_path):
    stashpoint.save(_state(1), tmp_path / "ck")
    with pytest.raises(CheckpointError, match=r"ck is a checkpoint .*not a run directory.*stashpoint\.load"):
        stashpoint.CheckpointManager(tmp_path / "ck")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if not p.name.startswith(("shard-", "index-"))) == [
        "manifest.json"
    ]  # no lock file dropped into it


def test_what_a_save_writes_is_told_from_what_it_does_not():
    ours = [
        "manifest.json",
        "shard-r00000-0000-abcd.safetensors",
        "g00001/index-r01024-abcd.json",
        ".shard-r00000-0000-abcd.safetensors.0123456789abcdef0123456789abcdef.partial",
        "g00001/.index-r01024-abcd.json.0123456789abcdef0123456789abcdef.partial",
        "partial-r00003",
        "replica-r00003",
        "recoverable.json",
    ]
    theirs = [
        "model.pt",
        "g00001/model.pt",
        "sub/manifest.json",
        "g00001/manifest.json",
        ".model.pt.0123456789abcdef0123456789abcdef.partial",
        ".manifest.json.xyz.partial",
        "g00001/partial-r00003",
        "notes/shard-r00000-0000-abcd.safetensors",
    ]
    assert all(map(written_by_a_save, ours)) and not any(map(written_by_a_save, theirs))


def _block_writer() -> threading.Event:
    gate = threading.Event()
    get_engine().executor.submit(gate.wait, 30)
    return gate


def test_on_busy_skip_skips_and_counts(tmp_path):
    seen = []
    with stashpoint.CheckpointManager(tmp_path / "r", on_busy="skip", on_save=seen.append) as mgr:
        gate = _block_writer()
        try:
            h1 = mgr.save(1, _state(1))
            h2 = mgr.save(2, _state(2))
            assert h2.done() and h2.wait().skipped and mgr.skipped == 1
            assert not h1.done()
        finally:
            gate.set()
        h1.wait()
        mgr.wait()
        assert mgr.steps() == [1]
        assert sorted((s.step, s.skipped) for s in seen) == [(1, False), (2, True)]


def test_an_on_save_callback_may_save_and_runs_in_order_off_the_writer_thread(tmp_path):
    """An export of each committed step. Before: the callback ran on the writer thread, so its
    save queued behind itself and the program hung in close()."""
    model = torch.nn.Linear(8, 8)
    threads, exported = [], []

    def export(stats):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread().name)
        stashpoint.save({"model": model}, tmp_path / "exports" / f"step-{stats.step}")
        exported.append(stats.step)

    with stashpoint.CheckpointManager(tmp_path / "r", on_save=export) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"model": model})
        mgr.wait()
        assert exported == [1, 2, 3]  # wait() waited for the callbacks, which ran in order
    assert not any("writer" in t for t in threads), threads
    back = {"model": torch.nn.Linear(8, 8)}
    stashpoint.load(back, tmp_path / "exports" / "step-3")
    assert torch.equal(back["model"].weight, model.weight)


def test_a_slow_on_save_keeps_the_steps_it_has_yet_to_see_warns_and_the_retention_catches_up(tmp_path, caplog):
    """Each step is kept until the callback has been called for it (here the callback reads
    its step), however far behind it falls; a callback falling behind is warned of, and once it
    has caught up the retention keeps keep_last again. Before, the steps piled up unexplained."""
    gate, seen = threading.Event(), []

    def read_back(stats):  # type: ignore[no-untyped-def]
        if stats.step == 2:
            assert gate.wait(60)
        seen.append((stats.step, float(stashpoint.read(stats.path)["w"][0])))

    with (
        caplog.at_level(logging.WARNING, logger="stashpoint"),
        stashpoint.CheckpointManager(tmp_path / "r", keep_last=1, on_save=read_back) as mgr,
    ):
        for step in range(1, 7):
            mgr.save(step, _state(step)).wait()
        time.sleep(0.2)  # the retention after step 6's commit has run
        assert mgr.steps() == [2, 3, 4, 5, 6], "kept: the callback has not been called for them"
        assert "steps in" in caplog.text and "wait for the on_save callback" in caplog.text
        gate.set()
        mgr.wait()
        assert mgr.steps() == [6]
    assert seen == [(s, float(s)) for s in range(1, 7)]


def test_close_beside_a_wait_on_another_thread_still_waits_for_the_save_in_flight(tmp_path):
    """Before: the first wait() took the list of saves in flight, so a close() on the other
    thread found nothing to wait for and released the root under the save; a second manager
    then removed its directory as a crash's leftover."""
    mgr = stashpoint.CheckpointManager(tmp_path / "r")
    gate = _block_writer()
    try:
        handle = mgr.save(1, _state(1))
        waiter = threading.Thread(target=mgr.wait)
        waiter.start()
        time.sleep(0.2)
        closer = threading.Thread(target=mgr.close)
        closer.start()
        closer.join(0.5)
        assert closer.is_alive(), "close() returned while the save was still in flight"
    finally:
        gate.set()
    closer.join(30)
    waiter.join(30)
    assert handle.done() and handle.wait().step == 1
    with stashpoint.CheckpointManager(tmp_path / "r") as again:
        assert again.steps() == [1]


def test_wait_or_close_from_the_managers_own_on_save_callback_is_refused_not_hung(tmp_path, caplog):
    """The callback runs on the manager's thread, which wait() and close() wait for. Before:
    a wait() there hung for ever, and a close() there left the root locked."""
    calls: list[str] = []
    with stashpoint.CheckpointManager(tmp_path / "r") as mgr:
        for what in ("wait", "close"):

            def callback(stats, what=what):  # type: ignore[no-untyped-def]
                try:
                    getattr(mgr, what)()
                except CheckpointError as e:
                    calls.append(str(e))

            mgr.on_save = callback
            mgr.save(len(calls) + 1, _state(1))
            mgr.wait()
    assert len(calls) == 2 and all("on_save callback" in c and "training loop" in c for c in calls), calls
    with stashpoint.CheckpointManager(tmp_path / "r") as again:  # the root was released
        assert again.steps() == [1, 2]


def test_a_skipped_save_does_not_restart_the_every_seconds_clock(tmp_path):
    """A skip is no save: the next maybe_save tries again. Before: the skip set the clock, so
    saves came twice as far apart as every_seconds while the writer was busy."""
    with stashpoint.CheckpointManager(tmp_path / "r", every_seconds=3600, on_busy="skip") as mgr:
        assert mgr.maybe_save(1, _state(1)) is None, "the clock starts at the manager's opening"
        gate = _block_writer()
        try:
            mgr._last_save_time = None  # as if an hour had passed
            first = mgr.maybe_save(1, _state(1))
            assert first is not None and not first.done()
            mgr._last_save_time = None  # as if an hour had passed
            skipped = mgr.maybe_save(2, _state(2))
            assert skipped is not None and skipped.wait().skipped
            assert mgr.should_save(3), "the skip restarted the clock"
        finally:
            gate.set()
        first.wait()
        assert mgr.maybe_save(3, _state(3)) is not None
        mgr.wait()
        assert mgr.steps() == [1, 3]


def test_on_busy_wait_applies_backpressure(tmp_path):
    with stashpoint.CheckpointManager(tmp_path / "r", on_busy="wait") as mgr:
        gate = _block_writer()
        h1 = mgr.save(1, _state(1))
        threading.Timer(0.3, gate.set).start()
        t0 = time.perf_counter()
        h2 = mgr.save(2, _state(2))
        assert time.perf_counter() - t0 >= 0.25 and h1.done()
        assert h2.blocking_s >= 0.25
        mgr.wait()
        assert mgr.steps() == [1, 2]


def test_max_inflight_two_stages_while_the_first_persists(tmp_path):
    with stashpoint.CheckpointManager(tmp_path / "r", max_inflight=2, on_busy="skip") as mgr:
        gate = _block_writer()
        try:
            h1, h2, h3 = (mgr.save(s, _state(s)) for s in (1, 2, 3))
            assert not h1.done() and not h2.done() and h3.wait().skipped
        finally:
            gate.set()
        mgr.wait()
        assert mgr.steps() == [1, 2]
        out = _state()
        mgr.restore(out, step=1)
        assert out["w"][0] == 1, "each in-flight save has its own staging buffers"


def test_restore_falls_back_when_the_newest_is_damaged(tmp_path, caplog):
    with stashpoint.CheckpointManager(tmp_path / "r", keep_last=None) as mgr:
        mgr.save(1, _state(1)).wait()
        mgr.save(2, _state(2)).wait()
        (shard,) = mgr.path(2).glob("shard-*")
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
        with pytest.raises(stashpoint.CorruptCheckpointError):
            mgr.restore(_state(), step=2)  # asked for by number: the error, no fallback
        out = _state()
        with caplog.at_level(logging.WARNING, logger="stashpoint"):
            assert mgr.restore(out) == 1 and out["w"][0] == 1
        # the log names the damage; a plain load's advice to load a good checkpoint is the restore's to follow
        assert "checksum mismatch" in caplog.text and "trying another" in caplog.text, caplog.text
        assert "Load a good checkpoint" not in caplog.text, caplog.text
        assert mgr.steps() == [1], "the damaged step is moved aside"
        assert len(list(mgr.root.glob("step-00000002.damaged-*"))) == 1, "and kept for inspection"
        assert "loads again once the file is back and the directory renamed step-00000002" in caplog.text
        mgr.save(2, _state(2)).wait()  # training can save that step again


def test_save_schedule(tmp_path):
    with stashpoint.CheckpointManager(tmp_path / "r", keep_last=None, every_steps=3) as mgr:
        handles = [mgr.maybe_save(step, _state(step)) for step in range(1, 10)]
        assert [h is not None for h in handles] == [s % 3 == 0 for s in range(1, 10)]
        mgr.wait()
        assert mgr.steps() == [3, 6, 9]
    with stashpoint.CheckpointManager(tmp_path / "r2") as mgr, pytest.raises(ValueError, match="every_steps"):
        mgr.should_save(1)


def test_a_resumed_loop_neither_saves_the_restored_step_again_nor_at_once_by_the_clock(tmp_path, monkeypatch):
    """A loop resuming with range(start, ...) passes the restored step to maybe_save again: it
    is committed, so no save is due (before: should_save said yes, then the save raised that the
    step already has a checkpoint). every_seconds counts from the end of the restore, which may
    take minutes (before: from the manager's opening, so the first step saved again at once)."""
    with stashpoint.CheckpointManager(tmp_path / "r", every_steps=10) as mgr:
        mgr.save(20, _state(20)).wait()
    with stashpoint.CheckpointManager(tmp_path / "r", every_steps=10) as mgr:
        assert mgr.restore(_state()) == 20
        assert not mgr.should_save(20) and mgr.maybe_save(20, _state(20)) is None
        assert mgr.maybe_save(30, _state(30)) is not None and mgr.should_save(20) is True, "after a save: as ever"
    import types

    import stashpoint._manager.manager as manager_module

    clock = [1000.0]  # the manager's own clock only: the rest of the library keeps real time
    monkeypatch.setattr(manager_module, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    real_restore = manager_module.restore_reported

    def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = real_restore(*args, **kwargs)
        clock[0] += 90  # a restore of a minute and a half
        return out

    monkeypatch.setattr(manager_module, "restore_reported", slow)
    with stashpoint.CheckpointManager(tmp_path / "r", every_seconds=60) as mgr:
        assert mgr.restore(_state()) == 30
        assert not mgr.should_save(31), "every_seconds counts from the restore's end"
        clock[0] += 61
        assert mgr.should_save(31)


def test_keep_best_warns_once_of_metrics_that_cannot_compete_and_takes_decimals(tmp_path, caplog):
    """A misspelt metric, or NaN, made the best steps go with no word (they never competed)."""
    import decimal

    with (
        caplog.at_level(logging.WARNING, logger="stashpoint"),
        stashpoint.CheckpointManager(tmp_path / "r", keep_last=1, keep_best=(1, "val_loss")) as mgr,
    ):
        for step, metrics in enumerate(({"valloss": 0.1}, {"valloss": 0.2}, {"val_loss": float("nan")}), 1):
            mgr.save(step, _state(step), metrics=metrics).wait()
        mgr.save(4, _state(4), metrics={"val_loss": decimal.Decimal("0.25")}).wait()
        mgr.save(5, _state(5)).wait()  # no metrics at all: documented not to compete, no word
        mgr.wait()
        assert mgr.steps() == [4, 5]
    said = [r.getMessage() for r in caplog.records if "keep_best" in r.getMessage()]
    assert len(said) == 2, said
    assert "step 1 will not count for keep_best" in said[0] and "'valloss'" in said[0]
    assert "step 3" in said[1] and "nan" in said[1]


def test_a_restore_that_finds_only_saves_that_never_committed_says_it_starts_afresh(tmp_path, caplog):
    """A copy of a run taken while it saved (cp -r beside the retention, which removes a step's
    manifest first) can hold steps none of which committed: the manager removes them as a
    crash's leftovers, and the restore then started afresh with no word beyond one line per
    directory. It now says that training starts afresh, and why."""
    with stashpoint.CheckpointManager(tmp_path / "run", keep_last=None) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step)).wait()
    for manifest in (tmp_path / "run").glob("step-*/manifest.json"):
        manifest.unlink()
    (tmp_path / "run" / "step-00000500").mkdir()  # a user's file where a step goes: kept, not counted
    (tmp_path / "run" / "step-00000500" / "model.pt").write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger="stashpoint"), stashpoint.CheckpointManager(tmp_path / "run") as mgr:
        assert mgr.restore(_state()) is None
    said = [r.getMessage() for r in caplog.records if "starts afresh" in r.getMessage()]
    assert len(said) == 1 and "the 3 step directories there held saves that never committed" in said[0], said
    assert (tmp_path / "run" / "step-00000500" / "model.pt").exists()
    caplog.clear()
    with stashpoint.CheckpointManager(tmp_path / "run") as mgr:  # a crash's leftover above a committed step
        mgr.save(4, _state(4)).wait()
    (tmp_path / "run" / "step-00000005").mkdir()
    (tmp_path / "run" / "step-00000005" / (next((tmp_path / "run" / "step-00000004").glob("shard-*")).name)).touch()
    with caplog.at_level(logging.WARNING, logger="stashpoint"), stashpoint.CheckpointManager(tmp_path / "run") as mgr:
        assert mgr.restore(_state()) == 4
    assert "starts afresh" not in caplog.text


def test_a_failed_save_raises_from_wait_leaves_nothing_and_training_goes_on(tmp_path):
    from test_errors import FailingStorage

    class Failing(FailingStorage):
        def __init__(self, root):
            super().__init__(root, budget=100)

    with stashpoint.CheckpointManager(tmp_path / "r", keep_last=1) as mgr:
        mgr.save(1, _state(1)).wait()
        mgr.storage_class = Failing
        h = mgr.save(2, _state(2))
        with pytest.raises(stashpoint.CheckpointError, match=r"step-00000002 failed: OSError.*No space left"):
            mgr.wait()
        assert isinstance(h.exception(), stashpoint.CheckpointError)
        assert mgr.steps() == [1] and not mgr.path(2).exists(), "nothing committed, partial files removed"
        mgr.storage_class = stashpoint._storage.local.LocalStorage
        mgr.save(2, _state(2)).wait()  # the next save works
        mgr.wait()
        assert mgr.steps() == [2]
    with stashpoint.CheckpointManager(tmp_path / "r3") as mgr, pytest.raises(stashpoint.UnsupportedStateError):
        mgr.save(1, {"cfg": object()})  # refused at once, on the caller's thread


@pytest.mark.timeout(180)
def test_sigkill_in_the_middle_of_saves_then_a_new_manager_recovers(tmp_path):
    root = tmp_path / "run"
    rng = random.Random(1234)
    for trial in range(3):
        proc = subprocess.Popen(
            [sys.executable, str(CHILD), "crash", str(root), "24"], stdout=subprocess.PIPE, text=True, env=_env()
        )
        committed = []
        assert proc.stdout is not None
        for line in proc.stdout:
            committed.append(int(line.split()[1]))
            if len(committed) >= 2:
                break
        time.sleep(rng.uniform(0.0, 0.3))  # land somewhere inside a later save
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        with stashpoint.CheckpointManager(root, keep_last=2) as mgr:
            latest = mgr.latest_step()
            assert latest is not None and latest >= committed[-1], (trial, latest, committed)
            for d in root.glob("step-*"):
                assert (d / "manifest.json").exists(), f"leftover {d} was not removed"
            n = 24 * 1024 * 1024 // 4
            out = {"w": torch.zeros(n), "b": torch.zeros(1000), "step": 0}
            assert mgr.restore(out) == latest
            assert out["step"] == latest and out["w"][0] == latest and out["w"][-1] == latest
            assert out["b"][0] == -latest
            for step in mgr.steps():  # every listed step is whole
                stashpoint.load(out, mgr.path(step))


@pytest.mark.timeout(300)
def test_host_memory_and_fds_stay_flat_over_hundreds_of_saves(tmp_path):
    mb, total = 8, 200
    r = subprocess.run(
        [sys.executable, str(CHILD), "memory", str(tmp_path / "r"), str(mb), str(total)],
        capture_output=True,
        text=True,
        timeout=280,
        env=_env(),
        check=False,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line.split() for line in r.stdout.splitlines() if line.startswith("rss")]
    (_, _, rss20, _, fds20), (_, _, rss_end, _, fds_end) = lines
    growth = int(rss_end) - int(rss20)
    print(f"RSS after 20 saves {int(rss20) / 2**20:.1f} MiB, after {total}: {int(rss_end) / 2**20:.1f} MiB")
    assert growth < 16 * 2**20, f"host memory grew by {growth / 2**20:.1f} MiB over {total - 20} saves"
    assert int(fds_end) <= int(fds20), "file descriptors leaked"
    assert len(list((tmp_path / "r").glob("step-*"))) == 2


def test_saving_a_step_that_is_still_being_saved_is_refused(tmp_path):
    with stashpoint.CheckpointManager(tmp_path / "r", keep_last=None) as mgr:
        gate = _block_writer()
        try:
            h = mgr.save(5, _state(5))
            with pytest.raises(stashpoint.CheckpointError, match="step 5 is still being saved"):
                mgr.save(5, _state(6))
            assert mgr.path(5).exists() or not h.done(), "the save in flight was not disturbed"
        finally:
            gate.set()
        h.wait()
        out = _state()
        assert mgr.restore(out) == 5 and out["w"][0] == 5


def test_manager_options_overlap_and_writer_apply_to_its_saves(tmp_path):
    with stashpoint.CheckpointManager(tmp_path / "r", overlap=True, writer="process") as mgr:
        stats = mgr.save(1, _state(1)).wait()
        assert stats.writer == "process"
        out = _state()
        assert mgr.restore(out) == 1 and out["w"][0] == 1.0
    with pytest.raises(ValueError, match="writer"):
        stashpoint.CheckpointManager(tmp_path / "r2", writer="nope")


def test_metrics_that_are_not_json_scalars_are_refused_by_key_before_anything_is_written(tmp_path):
    import numpy as np

    state = {"w": torch.ones(3)}
    with stashpoint.CheckpointManager(tmp_path / "run", keep_best=(1, "loss")) as mgr:
        with pytest.raises(TypeError, match=r"metrics\['loss'\] is a Tensor, not a JSON scalar: .*loss.item\(\)"):
            mgr.save(1, state, metrics={"loss": torch.tensor(0.5)})
        assert mgr.steps() == [] and not (tmp_path / "run" / "step-00000001").exists()
        metrics = {"loss": np.float32(0.25), "seen": np.int64(7), "val": None, "best": True, "phase": "warmup"}
        mgr.save(1, state, metrics=metrics)  # NumPy scalars as numbers, the other JSON scalars as they are
        mgr.wait()
    with stashpoint.CheckpointManager(tmp_path / "run") as mgr:
        assert mgr._metrics.of(1) == {"loss": 0.25, "seen": 7, "val": None, "best": True, "phase": "warmup"}


def test_restoring_a_step_the_run_lacks_names_the_steps_it_has(tmp_path):
    state = {"w": torch.ones(3)}
    with stashpoint.CheckpointManager(tmp_path / "run", keep_last=None) as mgr:
        for step in (2, 4):
            mgr.save(step, state)
        mgr.wait()
        held = r"step-00000099.*the committed steps there are 2, 4"
        with pytest.raises(stashpoint.CheckpointNotFoundError, match=held):
            mgr.restore(state, step=99)
        with pytest.raises(ValueError, match="maybe_save need a schedule"):
            mgr.maybe_save(5, state)


def test_a_manager_never_closed_finishes_its_saves_and_retention_at_exit(tmp_path):
    """The last save ends while the interpreter exits, after it stopped the manager's pool."""
    script = (
        "import sys, torch, stashpoint\n"
        "mgr = stashpoint.CheckpointManager(sys.argv[1], keep_last=1)\n"
        "for s in range(1, 4):\n"
        "    mgr.save(s, {'w': torch.full((256, 256), float(s))})\n"
    )
    run = tmp_path / "run"
    done = _script(script, run)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step-")) == ["step-00000003"]


def test_a_manager_on_a_read_only_root_says_what_reads_it(tmp_path):
    root = tmp_path / "ro"
    with stashpoint.CheckpointManager(root) as mgr:
        mgr.save(1, _state(1)).wait()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(root)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot mount a read-only file system here (needs root): {e}")
    try:
        with pytest.raises(stashpoint.CheckpointError, match=r"Read-only file system.*writable.*stashpoint.load"):
            stashpoint.CheckpointManager(root)
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False, timeout=30)


def test_a_metric_too_large_for_a_float_does_not_stop_the_retention(tmp_path):
    """An integer metric beyond a float's range (the user's, or a manifest's) does not compete
    for keep_best; retention and a manager opening with a remote tier go on."""
    root, remote = tmp_path / "run", tmp_path / "remote"
    kw = {"keep_last": 1, "keep_best": (1, "loss"), "remote_root": remote, "remote_keep_last": 1}
    with stashpoint.CheckpointManager(root, **kw) as mgr:
        mgr.save(1, {"w": torch.ones(4)}, metrics={"loss": 10**400}).wait()
    with stashpoint.CheckpointManager(root, **kw) as mgr:
        for s, loss in ((2, 3.0), (3, 1.0), (4, 2.0)):
            mgr.save(s, {"w": torch.ones(4)}, metrics={"loss": loss}).wait()
            mgr.wait()
        assert mgr.steps() == [3, 4]


def test_a_remote_tiers_retention_forgets_the_metrics_of_the_steps_it_deletes(tmp_path):
    """Before: the remote retention read each step's metrics again after the local retention had
    dropped them, and kept them for good: one entry per save, over a long run."""
    kw = {"keep_last": 2, "remote_root": tmp_path / "remote", "remote_keep_last": 2, "every_steps": 1}
    with stashpoint.CheckpointManager(tmp_path / "run", **kw) as mgr:
        for step in range(1, 31):
            mgr.maybe_save(step, {"w": torch.ones(4)}, metrics={"loss": 1.0 / step})
        mgr.wait()
        assert mgr.steps() == [29, 30] and mgr.remote_steps() == [29, 30]
        assert sorted(mgr._metrics) == [29, 30]


def test_an_on_save_calling_sys_exit_is_said_not_lost(tmp_path, caplog):
    """Before: a SystemExit raised in the callback (on its own thread) stopped it in silence."""

    def leave(stats) -> None:
        sys.exit(3)

    with (
        caplog.at_level(logging.ERROR, logger="stashpoint"),
        stashpoint.CheckpointManager(tmp_path / "run", on_save=leave) as mgr,
    ):
        mgr.save(1, {"w": torch.ones(4)})
        mgr.save(2, {"w": torch.ones(4)})
    said = [r.getMessage() for r in caplog.records if "on_save callback" in r.getMessage()]
    assert said == [f"stashpoint: the on_save callback for step {s} raised SystemExit; it was stopped" for s in (1, 2)]
    assert mgr.steps() == [1, 2]


def test_an_upload_backlog_is_warned_of_as_it_grows_not_at_every_save(tmp_path, caplog):
    """Before: every save past the third waiting for its upload logged the warning again."""
    import concurrent.futures as cf

    def said() -> list[int]:
        msgs = [r.getMessage() for r in caplog.records if "wait for their upload" in r.getMessage()]
        return [int(m.split()[1]) for m in msgs]

    with stashpoint.CheckpointManager(tmp_path / "run", keep_last=2, remote_root=tmp_path / "remote") as mgr:
        uploader, held = mgr._tier.uploader, []
        real = uploader.submit
        uploader.submit = lambda step, after: held.append((step, cf.Future())) or held[-1][1]  # never end alone

        def end(n: int) -> None:  # the oldest n uploads end
            for _ in range(n):
                step, f = held.pop(0)
                mgr._tier._result(step, True)
                f.set_result(None)

        try:
            with caplog.at_level(logging.WARNING, logger="stashpoint"):
                for step in range(1, 21):
                    mgr.save(step, {"w": torch.ones(4)}).wait()
                assert said() == [4, 9, 19]
                end(len(held) - 2)
                for step in range(21, 41):  # uploads keep pace, 2-4 behind: nothing more to say
                    mgr.save(step, {"w": torch.ones(4)}).wait()
                    if step % 2 == 0:
                        end(2)
                assert said() == [4, 9, 19]
                end(len(held))  # caught up: a backlog growing again is said again
                for step in range(41, 46):
                    mgr.save(step, {"w": torch.ones(4)}).wait()
                assert said() == [4, 9, 19, 4]
                assert "uploads are slower than saves" in caplog.records[-1].getMessage()
                for step, f in held[:]:  # every upload fails: no slowness, retried after one commits
                    mgr._tier._result(step, None)
                    f.set_result(None)
                held.clear()
                for step in range(46, 51):
                    mgr.save(step, {"w": torch.ones(4)}).wait()
                assert said()[-1] == 9, said()
                last = caplog.records[-1].getMessage()
                assert "5 of them failed to upload and are tried again after the next upload that commits" in last, last
        finally:
            uploader.submit = real
            for _, f in held:  # else closing waits for them
                f.set_result(None)


def test_an_option_a_managers_save_does_not_take_is_named(tmp_path):
    with stashpoint.CheckpointManager(tmp_path / "run") as mgr:
        for option in ("overwrite", "refused", "nodes", "overlapp"):
            with pytest.raises(TypeError, match=rf"unexpected option\(s\) '{option}'; it takes allow_pickle"):
                mgr.save(1, {"w": torch.ones(2)}, **{option: True})
        assert mgr.steps() == []


_DELETER = """
import sys, time
import torch
import stashpoint
from stashpoint._storage.local import LocalStorage

real = LocalStorage.remove_tree

def stalled(self):  # the retention's deletion of a step with files, frozen for the kill
    if self.root.is_dir() and any(p.name.startswith("shard-") for p in self.root.iterdir()):
        print("DELETING", self.root.name, flush=True)
        time.sleep(60)
    real(self)

LocalStorage.remove_tree = stalled
with stashpoint.CheckpointManager(sys.argv[1], keep_last=1) as mgr:
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((1000,), float(step))}).wait()
    time.sleep(60)
"""


def test_a_retention_killed_mid_deletion_leaves_an_uncommitted_leftover_not_a_torn_step(tmp_path):
    """The retention takes a step's manifest first: a kill -9 inside the deletion leaves files
    that no listing takes for a committed step, and the next manager removes them."""
    root = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", _DELETER, str(root)], stdout=subprocess.PIPE, text=True, env=_env())
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("DELETING step-"), line
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    doomed = root / line.split()[1]
    assert doomed.exists() and any(doomed.iterdir()), "killed before any file went"
    assert not (doomed / "manifest.json").exists(), "the manifest goes first"
    with stashpoint.CheckpointManager(root, keep_last=1) as mgr:
        assert mgr.steps() == [2]
        out = {"w": torch.zeros(1000)}
        assert mgr.restore(out) == 2 and out["w"][0] == 2.0
    assert not doomed.exists(), "the leftover was removed when the manager opened"


def test_a_hard_linked_copy_of_a_root_in_use_names_its_lock_file_as_a_link(tmp_path):
    """Before: a `cp -al` snapshot of a run in use was refused as owned by another manager."""
    with stashpoint.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"w": torch.ones(2)}).wait()
        subprocess.run(["cp", "-al", str(tmp_path / "run"), str(tmp_path / "snap")], check=True)
        with pytest.raises(CheckpointError, match=r"is a hard link to another directory's.*remove this copy's lock"):
            stashpoint.CheckpointManager(tmp_path / "snap")
        (tmp_path / "snap" / ".stashpoint-manager.lock").unlink()
        with stashpoint.CheckpointManager(tmp_path / "snap") as snap:
            assert snap.restore({"w": torch.zeros(2)}) == 1


def test_a_manager_collected_without_close_releases_its_root(tmp_path):
    """Before: its lock stayed open for the life of the process (a notebook's cell run again
    was refused: "another CheckpointManager already owns"), and the save's handle kept the
    manager itself alive."""
    import gc
    import weakref

    mgr = stashpoint.CheckpointManager(tmp_path / "run")
    mgr.save(1, {"w": torch.ones(4)}).wait()
    mgr.wait()
    gone = weakref.ref(mgr)
    del mgr
    gc.collect()
    assert gone() is None
    with stashpoint.CheckpointManager(tmp_path / "run") as again:
        assert again.steps() == [1]


def test_a_closed_managers_staging_buffers_beyond_one_are_given_back(tmp_path):
    """Before: max_inflight=3 left the pool keeping three idle copies of the state for the
    life of the process, after the manager closed and for every later save."""
    from stashpoint._save.engine import get_engine

    state = {"w": torch.ones(1 << 16)}
    with stashpoint.CheckpointManager(tmp_path / "run", max_inflight=3) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state)
        mgr.wait()
        assert get_engine().pool.max_free == 3
    assert get_engine().pool.max_free == 1  # the extra buffers go as the next save releases its own
    stashpoint.save(state, tmp_path / "plain")
    assert get_engine().pool.max_free == 1 and len(get_engine().pool._free) <= 1


_EXPORT_AT_EXIT = """
import sys, torch, stashpoint
base, inflight = sys.argv[1], int(sys.argv[2])
model = torch.nn.Linear(256, 256)
def export(stats):  # the documented use of on_save: it saves
    stashpoint.save({"model": model}, f"{base}/export-{stats.step}")
    with open(f"{base}/order", "a") as f:
        f.write(f"{stats.step} ")
mgr = stashpoint.CheckpointManager(f"{base}/run", on_save=export, max_inflight=inflight)
for step in (1, 2, 3, 4):
    mgr.save(step, {"model": model})
"""  # and the program ends without close(): the interpreter's exit runs what is left


@pytest.mark.parametrize("inflight", [1, 2])
def test_an_on_save_that_saves_still_saves_at_interpreter_exit(tmp_path, inflight):
    """Before: the saves of the callbacks that ran at exit failed ("cannot schedule new futures
    after interpreter shutdown", logged), and the process exited 0 without those exports; later,
    with two saves in flight, a callback left to exit ran on the writer thread, out of order, and
    its save waited there for that thread for ever."""
    res = _script(_EXPORT_AT_EXIT, tmp_path, inflight)
    assert res.returncode == 0 and "raised" not in res.stderr, res.stderr[-3000:]
    for step in (1, 2, 3, 4):
        assert stashpoint.verify(tmp_path / f"export-{step}").ok
    assert (tmp_path / "order").read_text().split() == ["1", "2", "3", "4"]


_AT_EXIT_BESIDE = """
import os, sys, threading, time, torch, stashpoint
from stashpoint._storage import LocalStorage
base, how = sys.argv[1], sys.argv[2]
if how == "fork":  # a child forked while a callback runs has none of the parent's threads to wait for
    mgr = stashpoint.CheckpointManager(f"{base}/run", on_save=lambda stats: time.sleep(6))
    mgr.save(1, {"w": torch.zeros(1000)}).wait()
    pid = os.fork()
    if pid == 0:
        sys.exit(0)
    t0 = time.monotonic()
    os.waitpid(pid, 0)
    print(f"child {time.monotonic() - t0:.1f}", flush=True)
else:  # a thread still running keeps its own failure to close() with
    class Full(LocalStorage):
        def open_writer(self, name, size):
            raise OSError(28, "No space left on device")

    def train():
        mgr = stashpoint.CheckpointManager(f"{base}/run")
        mgr.storage_class = Full
        mgr.save(1, {"w": torch.zeros(1000)})
        time.sleep(2)
        try:
            mgr.close()
            print("close raised nothing", flush=True)
        except stashpoint.CheckpointError as e:
            print("close raised", type(e).__name__, flush=True)

    threading.Thread(target=train).start()
    time.sleep(0.5)
"""  # the main thread returns: the interpreter's exit begins while the manager is still used


@pytest.mark.parametrize("how", ["fork", "thread"])
def test_the_exit_hook_waits_neither_in_a_forked_child_nor_takes_a_running_threads_failure(tmp_path, how):
    """A manager never closed has its saves and callbacks end at interpreter exit. Before the
    fix of that hook, a child forked while a callback ran (a DataLoader worker) waited at its exit
    for the parent's threads, which it has not (hung), and a thread still using the manager found
    its save's failure taken by the hook, its close() raising nothing."""
    res = _script(_AT_EXIT_BESIDE, tmp_path, how, timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    if how == "fork":
        assert float(res.stdout.split("child ")[1]) < 4.0, res.stdout  # waiting: 6 s; a loaded host's exit: 2
    else:
        assert "close raised CheckpointError" in res.stdout, (res.stdout, res.stderr[-2000:])


_UPLOAD_AFTER_EXIT = """
import atexit, sys, threading, time, torch, stashpoint
base, how = sys.argv[1], sys.argv[2]
state = {"w": torch.zeros(1 << 12), "step": 0}
def run(steps):
    mgr = stashpoint.CheckpointManager(f"{base}/run", keep_last=2, remote_root=f"{base}/remote")
    for s in steps:
        state["step"] = s
        mgr.save(s, state)
        time.sleep(0.3)
    mgr.close()
    print("closed", mgr.remote_steps(), flush=True)
if how == "atexit":  # a last save from an atexit hook: the interpreter's pools are stopped by then
    atexit.register(run, [7, 8])
else:  # training on a thread the main thread leaves running: its saves come after the pools stopped
    threading.Thread(target=run, args=([1, 2, 3, 4, 5],)).start()
    time.sleep(0.5)
"""


@pytest.mark.parametrize("how", ["atexit", "thread"])
def test_saves_with_a_remote_tier_after_the_interpreters_exit_began_upload_on_the_spot(tmp_path, how):
    """Before: mgr.save raised "cannot schedule new futures after shutdown" from the upload's
    queue (the step committed locally, the caller got the error, the loop died, and the step
    stayed protected as pending for the rest of the run)."""
    res = _script(_UPLOAD_AFTER_EXIT, tmp_path, how)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    steps = [7, 8] if how == "atexit" else [1, 2, 3, 4, 5]
    assert f"closed {steps}" in res.stdout, (res.stdout, res.stderr[-2000:])
    assert sorted(p.name for p in (tmp_path / "run").glob("step-*")) == [step_dir(s) for s in steps[-2:]]
    assert all(stashpoint.verify(tmp_path / "remote" / step_dir(s)).ok for s in steps)


_HUNG_AT_EXIT = """
import sys, time, torch, stashpoint
mgr = stashpoint.CheckpointManager(sys.argv[1], on_save=lambda stats: time.sleep(600))
mgr.save(1, {"w": torch.zeros(8)})
print("saved", flush=True)
"""  # and the program ends, never closing the manager, its callback hung


def test_ctrl_c_at_exit_with_a_hung_on_save_says_that_a_second_one_ends_the_program(tmp_path):
    """Python's own exit then joins the callback's thread: one Ctrl-C stops stashpoint's wait,
    not Python's. Before, nothing said so and the program seemed to ignore Ctrl-C."""
    env = _env()
    proc = subprocess.Popen(
        [sys.executable, "-c", _HUNG_AT_EXIT, str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "saved\n"
    time.sleep(1.5)  # at exit, waiting for the callback
    proc.send_signal(signal.SIGINT)
    time.sleep(1.5)
    assert proc.poll() is None, "Python itself still waits for the callback's thread"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert "press Ctrl-C again to end the program now" in err, err[-2000:]


def test_settling_a_manager_at_exit_says_what_it_waits_for_once_it_takes_long(tmp_path, caplog):
    """A program that seemed to hang at its end printed nothing: the exit hook waits for the
    saves and callbacks of a manager never closed, and now says so past its mark."""
    from stashpoint._manager.callbacks import settle

    gate = threading.Event()
    with (
        caplog.at_level(logging.WARNING, logger="stashpoint"),
        stashpoint.CheckpointManager(tmp_path / "r", on_save=lambda stats: gate.wait(30)) as mgr,
    ):
        mgr.save(1, _state(1)).wait()
        threading.Timer(1.0, gate.set).start()
        settle(mgr, say_after=0.3)
        said = [r.getMessage() for r in caplog.records if "the program is ending" in r.getMessage()]
        assert len(said) == 1 and "on_save call(s) of the CheckpointManager on" in said[0], said
        assert gate.is_set(), "it waited for the callback"
