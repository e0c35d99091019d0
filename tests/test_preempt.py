"""Preemption (issue 21): a real SIGTERM to a training process, or to one of two torchrun nodes,
makes every rank save the step it is at, commit it and exit; a fresh process resumes there."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import stashpoint
from conftest import ROOT
from dist_util import free_port

WORKER = Path(__file__).with_name("preempt_worker.py")
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}


def _progress(d: Path, rank: int = 0) -> int:
    try:
        return int((d / f"progress-{rank}").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def _wait_for(cond, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _steps(d: Path) -> list[int]:
    with stashpoint.CheckpointManager(d / "ckpt") as mgr:
        return mgr.steps()


@pytest.mark.parametrize(  # the slow tier: a save in flight at the signal as well
    "every", [pytest.param(1000, id="no-save-due"), pytest.param(1, id="a-save-every-step", marks=pytest.mark.slow)]
)
def test_sigterm_saves_the_current_step_commits_it_and_exits_then_a_fresh_process_resumes_there(tmp_path, every):
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(tmp_path), "200", "--every", str(every)], env=ENV, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _wait_for(lambda: _progress(tmp_path) >= 4 or proc.poll() is not None, "step 4")
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    at = _progress(tmp_path)
    # every 1000: no save was due, the emergency save is the only step; every step: the save in
    # flight finished, and this step (its own save not yet started) was saved on top
    assert _steps(tmp_path) == ([at] if every == 1000 else [at - 2, at - 1, at])
    assert f"preempted by SIGTERM: step {at} committed" in err
    assert not (tmp_path / "done-0").exists()
    res = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path), str(at + 2)], env=ENV, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"RESUMED {at}" in res.stdout


def test_sigterm_to_one_of_two_nodes_stops_both_at_the_same_step_with_one_committed_checkpoint(tmp_path):
    """Two torchrun agents on this host are two nodes (one rank each). Only node 1's agent gets
    SIGTERM (it passes it to its rank); the ranks agree at the next maybe_save, both save that step
    and exit."""
    port = free_port()

    def node(rank: int) -> subprocess.Popen[str]:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
            "--node_rank", str(rank), "--rdzv_backend", "c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
            "--rdzv_id", "preempt", "--max_restarts", "0", str(WORKER), str(tmp_path), "200",
        ]  # fmt: skip
        return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    nodes = [node(0), node(1)]
    try:
        _wait_for(lambda: min(_progress(tmp_path, r) for r in (0, 1)) >= 4, "both nodes at step 4")
        nodes[1].send_signal(signal.SIGTERM)
        logs = [p.communicate(timeout=90)[1] for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    committed = _steps(tmp_path)
    assert len(committed) == 1, (committed, logs[0][-2000:], logs[1][-2000:])
    (at,) = committed
    assert _progress(tmp_path, 0) == _progress(tmp_path, 1) == at
    for log in logs:
        assert f"preempted by SIGTERM: step {at} committed" in log, log[-3000:]
    manifest = json.loads((tmp_path / "ckpt" / f"step-{at:08d}" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert stashpoint.verify(tmp_path / "ckpt" / f"step-{at:08d}").ok


def _start(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(WORKER), str(tmp_path), *args]
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize(
    "case",
    [
        "stuck",
        pytest.param("twice", marks=pytest.mark.slow),
        pytest.param("after-the-last-step", marks=pytest.mark.slow),
    ],
)
def test_sigterm_ends_the_process_when_no_safe_point_comes(tmp_path, case):
    """Before: a process that never reached maybe_save again (an evaluation, a hung
    collective) ignored SIGTERM, sent twice, until SIGKILL; one signalled after its last
    maybe_save exited 0 with nothing said. A second signal (a launcher passing on what the
    scheduler sent every process) changes nothing: the deadline runs from the first."""
    args = {
        "stuck": ["50", "--stuck-at", "3", "--deadline", "2"],
        "twice": ["50", "--stuck-at", "3", "--deadline", "3"],
        "after-the-last-step": ["3", "--after", "4", "--deadline", "60"],
    }[case]
    proc = _start(tmp_path, *args)
    try:
        _wait_for(lambda: _progress(tmp_path) >= 3 or proc.poll() is not None, "step 3")
        time.sleep(0.5)  # past the maybe_save of step 3
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        if case == "twice":
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    assert proc.returncode in (128 + signal.SIGTERM, -signal.SIGTERM), (proc.returncode, err[-3000:])
    if case == "stuck":
        assert 1.5 < took < 10, took
        assert "the 2 s deadline passed before training reached a safe point" in err, err[-3000:]
    elif case == "twice":
        assert 2.5 < took < 10, took
        assert "the 3 s deadline passed before training reached a safe point" in err, err[-3000:]
    else:
        assert "SIGTERM came after the last maybe_save" in err, err[-3000:]
    assert not (tmp_path / "done-0").exists()


def test_a_deadline_shorter_than_the_save_exits_at_the_deadline_and_the_restart_loads_the_step_before(tmp_path):
    """Before: the log said the save was abandoned, then closing the manager waited for it."""
    proc = _start(tmp_path, "50", "--every", "2", "--mb", "800", "--deadline", "0.8")
    try:
        committed = tmp_path / "ckpt" / "step-00000002" / "manifest.json"
        _wait_for(lambda: committed.exists() or proc.poll() is not None, "step 2 committed")
        at = _progress(tmp_path)
        _wait_for(lambda: _progress(tmp_path) > at or proc.poll() is not None, "the next step")
        proc.send_signal(signal.SIGTERM)  # its maybe_save comes in 0.2 s; its save takes longer than the rest
        t0 = time.monotonic()
        _out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert took < 4, took  # the deadline (0.8 s), a moment to report, and the exit
    assert "no new step committed" in err and "exiting now, without a new checkpoint" in err, err[-3000:]
    steps = _steps(tmp_path)
    res = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path), "0", "--mb", "800"], env=ENV, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert f"RESUMED {steps[-1]}" in res.stdout, (steps, res.stderr[-3000:])


def test_ranks_that_call_maybe_save_at_different_steps_are_told_not_paired(tmp_path):
    """Before: with preemption on, every maybe_save is an all-reduce; a rank that skipped one
    paired its calls with the others' next ones and the job hung at the end."""
    from dist_util import run_world

    results = run_world(2, str(tmp_path), "6", "--skip", "3", worker=WORKER, allow_fail=True, timeout=120)
    for r in results:
        assert "called maybe_save at different steps (3 to 4)" in r.get("error", ""), results


def test_managers_with_preemption_opened_and_closed_leave_no_thread_fd_or_handler(tmp_path):
    import threading

    before_fds, handler = len(os.listdir("/proc/self/fd")), signal.getsignal(signal.SIGTERM)
    for i in range(20):
        with stashpoint.CheckpointManager(tmp_path / f"r{i}", preemption_deadline=5):
            pass
    _wait_for(lambda: not [t for t in threading.enumerate() if t.name == "stashpoint-preemption"], "watchdogs", 10)
    assert len(os.listdir("/proc/self/fd")) <= before_fds
    assert signal.getsignal(signal.SIGTERM) is handler
    assert signal.set_wakeup_fd(-1) == -1, "the wakeup fd is given back"


def test_a_signal_no_program_can_catch_is_refused_leaving_the_signals_and_the_root_as_they_were(tmp_path):
    """Before: SIGTERM was taken over, then SIGKILL failed with a bare OSError; SIGTERM's
    handler was never given back (the process ignored it) and the root stayed locked."""
    handler = signal.getsignal(signal.SIGTERM)
    for bad, named in ((signal.SIGKILL, "SIGKILL"), (999, "signal 999")):
        with pytest.raises(ValueError, match=f"preemption_signals holds {named}, which a program cannot catch"):
            stashpoint.CheckpointManager(
                tmp_path / "r", preemption_deadline=5, preemption_signals=(signal.SIGTERM, bad)
            )
        assert signal.getsignal(signal.SIGTERM) is handler
    with stashpoint.CheckpointManager(tmp_path / "r") as mgr:  # not locked
        assert mgr.steps() == []


_SAVE_IN_HANDLER = """
import os, signal, sys, torch, stashpoint
from stashpoint.errors import CheckpointError
class Interrupted:  # the signal lands while the save's call stages this object
    def state_dict(self):
        os.kill(os.getpid(), signal.SIGTERM)
        return {"x": torch.ones(4)}
    def load_state_dict(self, sd):
        pass
def on_term(signum, frame):
    stashpoint.save({"w": torch.ones(2)}, sys.argv[1] + "/on-term")
signal.signal(signal.SIGTERM, on_term)
try:
    stashpoint.save({"obj": Interrupted()}, sys.argv[1] + "/periodic")
except CheckpointError as e:
    print("refused:", e)
stashpoint.save({"w": torch.ones(2)}, sys.argv[1] + "/after")  # the lock was let go
print("saved after")
"""


def test_a_save_from_a_signal_handler_inside_a_saves_call_is_refused_not_hung(tmp_path):
    """Before: the handler's save waited for the lock the interrupted call held, on the same
    thread: the process hung until SIGKILL and neither checkpoint was written."""
    out = subprocess.run(
        [sys.executable, "-c", _SAVE_IN_HANDLER, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "refused: a save was started while another save's call was running on the same thread" in out.stdout
    assert "preemption_deadline" in out.stdout and "saved after" in out.stdout
    assert stashpoint.read(tmp_path / "after")["w"].tolist() == [1.0, 1.0]


def test_a_second_manager_handling_preemption_in_one_process_is_refused(tmp_path):
    """Before: the one opened last alone saw the signal; a GAN's two managers resumed at
    different steps (the generator's at its last scheduled save, the discriminator's at the
    step it stopped at)."""

    def mine(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        a = stashpoint.CheckpointManager(tmp_path / "a", preemption_deadline=5)
        with pytest.raises(ValueError, match=rf"another CheckpointManager of this process \(on {tmp_path / 'a'}\) "):
            stashpoint.CheckpointManager(tmp_path / "b", preemption_deadline=5)
        assert signal.getsignal(signal.SIGTERM) == a._preemption._note, "the open manager's handler stays"
        with stashpoint.CheckpointManager(tmp_path / "b"):  # without preemption handling: fine
            pass
        a.close()
        assert signal.getsignal(signal.SIGTERM) is mine
        with stashpoint.CheckpointManager(tmp_path / "b", preemption_deadline=5):  # once the first is closed
            pass
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_manager_handling_preemption_collected_without_close_gives_the_signals_back(tmp_path):
    """A notebook's manager left open, its cell run again: its handler and watchdog go with it,
    and the next manager may handle preemption (else it was refused for ever, naming it)."""
    import gc

    def mine(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        mgr = stashpoint.CheckpointManager(tmp_path / "a", preemption_deadline=5)
        mgr.save(1, {"w": torch.ones(2)})
        mgr.wait()
        del mgr
        gc.collect()
        assert signal.getsignal(signal.SIGTERM) is mine
        with stashpoint.CheckpointManager(tmp_path / "b", preemption_deadline=5) as again:
            assert signal.getsignal(signal.SIGTERM) == again._preemption._note
    finally:
        signal.signal(signal.SIGTERM, before)


_FORK_CHILD = """
import multiprocessing as mp, sys, time, torch, stashpoint
with stashpoint.CheckpointManager(sys.argv[1], every_steps=1000, preemption_deadline=1) as mgr:
    p = mp.get_context("fork").Process(target=time.sleep, args=(30,))
    p.start()
    time.sleep(0.5)
    p.terminate()  # SIGTERM to the child
    p.join(10)
    for step in range(1, 16):
        time.sleep(0.2)
        mgr.maybe_save(step, {"w": torch.ones(2)})
print("child exit", p.exitcode, "steps", mgr.steps(), flush=True)
"""


def test_a_signal_to_a_forked_child_is_the_childs_not_the_parents(tmp_path):
    """Before: the child inherited the handler (it ignored SIGTERM) and the wakeup pipe (its
    signal started the parent's deadline, and the parent exited 143 without a checkpoint)."""
    res = subprocess.run(
        [sys.executable, "-c", _FORK_CHILD, str(tmp_path / "ckpt")], env=ENV, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"child exit {-signal.SIGTERM} steps []" in res.stdout, (res.stdout, res.stderr[-3000:])


def test_a_signal_raised_again_at_close_finds_the_manager_closed(tmp_path):
    """Before: the signal was raised inside close(), before the root was released: a handler
    of the program's that raised left the manager half closed."""

    def raising(signum, frame):
        raise RuntimeError("the program's own handler")

    previous = signal.signal(signal.SIGTERM, raising)
    try:
        mgr = stashpoint.CheckpointManager(tmp_path / "run", every_steps=1, preemption_deadline=30)
        mgr.maybe_save(1, {"w": torch.ones(2)})
        assert not mgr.preempted
        os.kill(os.getpid(), signal.SIGTERM)  # after the last maybe_save: noted, not answered
        time.sleep(0.1)
        assert mgr.preempted, "an evaluation can see it and return early"
        with pytest.raises(RuntimeError, match="the program's own handler"):
            mgr.close()
        with stashpoint.CheckpointManager(tmp_path / "run") as again:  # the root was released
            assert again.steps() == [1]
    finally:
        signal.signal(signal.SIGTERM, previous)


_THREAD_CLOSE = """
import os, signal, sys, threading, time, stashpoint
fds = len(os.listdir("/proc/self/fd"))
mgr = stashpoint.CheckpointManager(sys.argv[1] + "/a", preemption_deadline=5)
t = threading.Thread(target=mgr.close)
t.start()
t.join()
if sys.argv[2] == "reopen":  # a manager opened and closed in the main thread tidies up after it
    time.sleep(1)
    with stashpoint.CheckpointManager(sys.argv[1] + "/b", preemption_deadline=5):
        pass
    time.sleep(1)
    print("fds", len(os.listdir("/proc/self/fd")) - fds, "handler", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
          "wakeup", signal.set_wakeup_fd(-1), flush=True)
    sys.exit(0)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(3)
print("survived SIGTERM", flush=True)
"""


@pytest.mark.parametrize("then", ["sigterm", "reopen"])
def test_a_manager_closed_from_another_thread_gives_the_signals_back(tmp_path, then):
    """Before: closed from a thread other than the main one, the manager could not put the
    handlers back, so a later SIGTERM was swallowed (the process lived on until SIGKILL), and
    its wakeup pipe leaked. Now its handler hands the signal on, and the next manager opened
    in the main thread tidies up after it."""
    res = subprocess.run(
        [sys.executable, "-c", _THREAD_CLOSE, str(tmp_path), then], env=ENV, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    if then == "sigterm":
        assert res.returncode == -signal.SIGTERM, (res.returncode, res.stdout, res.stderr[-3000:])
    else:
        assert res.returncode == 0, res.stderr[-3000:]
        assert "fds 0 handler True wakeup -1" in res.stdout, (res.stdout, res.stderr[-3000:])


_FAILS_FAST = """
import os, signal, sys, torch, stashpoint
mgr = stashpoint.CheckpointManager(sys.argv[1], every_steps=1000, preemption_deadline=30)
try:
    os.kill(os.getpid(), signal.SIGTERM)
    mgr.maybe_save(1, {"w": torch.ones(2), "bad": object()})  # a state the emergency save refuses
    print("not stopped", flush=True)
finally:
    print("the program's clean-up ran", flush=True)
"""


def test_an_emergency_save_that_fails_before_the_deadline_lets_the_programs_clean_up_run(tmp_path):
    """The save at the safe point fails at once: the process still exits as the signal asked,
    through SystemExit (the program's ``finally`` blocks run), not at the deadline."""
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-c", _FAILS_FAST, str(tmp_path / "ckpt")], env=ENV, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert res.returncode == 128 + signal.SIGTERM, res.stderr[-3000:]
    assert "the program's clean-up ran" in res.stdout and "not stopped" not in res.stdout, res.stdout
    assert "no new step committed" in res.stderr, res.stderr[-3000:]
    assert time.monotonic() - t0 < 25, "it exited at the deadline, not when the save failed"
    assert _steps(tmp_path) == []


def test_a_signal_while_the_manager_gives_its_handler_back_reaches_the_program_once(tmp_path, monkeypatch):
    """Before: a SIGTERM arriving inside close() (a launcher passing on a second one) ran the
    give-back again from the handler: a KeyError out of close(), or the pipe's write end closed
    twice, which closes whatever file got that number meanwhile."""
    from stashpoint._manager import preempt

    got: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    closes: list[int] = []
    real_close = os.close
    try:
        mgr = stashpoint.CheckpointManager(tmp_path / "a", preemption_deadline=5)
        write_end = mgr._preemption._wakeup[1]

        class SignalInside(set):  # the give-back's first step: a signal comes right then
            def discard(self, item):
                super().discard(item)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # its handler runs here, between two steps of the give-back

        monkeypatch.setattr(preempt, "_left", SignalInside())
        monkeypatch.setattr(os, "close", lambda fd: (closes.append(fd), real_close(fd))[1])
        mgr.close()
        _wait_for(lambda: got == [signal.SIGTERM], "the program's handler", 5)
        assert closes.count(write_end) == 1, closes
    finally:
        monkeypatch.undo()
        signal.signal(signal.SIGTERM, before)


_CHAINED = """
import os, signal, sys, threading, time, stashpoint
ran = []
signal.signal(signal.SIGTERM, lambda s, f: ran.append("first"))
mgr = stashpoint.CheckpointManager(sys.argv[1], preemption_deadline=5)
before = signal.getsignal(signal.SIGTERM)
def chaining(s, f):  # installed after the manager, calling the handler it replaced (Lightning's way)
    ran.append("chaining")
    before(s, f)
signal.signal(signal.SIGTERM, chaining)
if sys.argv[2] == "thread":
    t = threading.Thread(target=mgr.close); t.start(); t.join()
else:
    mgr.close()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.3)
print("ran", "+".join(ran), flush=True)
"""

_IN_CLOSE = """
import os, signal, sys, time, weakref, stashpoint
from stashpoint._manager import preempt
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
mgr = stashpoint.CheckpointManager(sys.argv[1], preemption_deadline=5)
class SignalInside(weakref.WeakSet):  # a SIGTERM lands inside Preemption.close()
    def discard(self, item):
        super().discard(item)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
preempt._live = SignalInside(preempt._live)
mgr.close()
time.sleep(0.3)
print("got", got, flush=True)
"""

_ASYNCIO_FORK = """
import asyncio, os, signal, sys, stashpoint
mgr = stashpoint.CheckpointManager(sys.argv[1], preemption_deadline=5)
loop = asyncio.new_event_loop()
loop.add_signal_handler(signal.SIGUSR1, lambda: None)  # asyncio takes the wakeup fd
theirs = signal.set_wakeup_fd(-1); signal.set_wakeup_fd(theirs)
pid = os.fork()
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
now = signal.set_wakeup_fd(-1); signal.set_wakeup_fd(now)
print("asyncio's wakeup fd kept", now == theirs, flush=True)
"""


@pytest.mark.parametrize(
    "script, arg, want",
    [
        (_CHAINED, "main", "ran chaining+first\n"),
        (_CHAINED, "thread", "ran chaining+first\n"),
        (_IN_CLOSE, "", "got [15]"),
        (_ASYNCIO_FORK, "", "asyncio's wakeup fd kept True"),
    ],
    ids=["chained-after-close", "chained-after-a-thread-closed-it", "signal-inside-close", "asyncio-and-fork"],
)
def test_signals_around_a_closed_manager_reach_the_program(tmp_path, script, arg, want):
    """Before: a handler of the program's that calls the one it replaced (the manager's) looped
    until RecursionError once the manager was closed; a SIGTERM landing inside close() was
    noted and then dropped; a fork put the manager's wakeup fd in place of asyncio's."""
    res = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "ckpt"), arg], env=ENV, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert want in res.stdout, (res.stdout, res.stderr[-3000:])


@pytest.mark.parametrize("world", [pytest.param(3, marks=pytest.mark.slow), 5])
def test_the_per_step_agreement_is_a_tree_that_every_rank_ends_with(tmp_path, world):
    """maybe_save's agreement on a signal runs every step: a tree up to rank 0 and a broadcast
    (2 log2 R messages in sequence, where a ring all-reduce takes 4R); every rank ends with the
    maximum, for worlds that are not powers of two too."""
    from dist_util import run_world

    for r in run_world(world, "tree_max", str(tmp_path)):
        assert r["got"] == r["want"], r


def test_a_preempted_job_uploads_its_last_step_before_the_older_ones_queued(tmp_path):
    """Uploads of 4 s a step, a save every second step, SIGTERM at step 7: the process saves step
    8 and exits once that step is uploaded. Before: close() uploaded every queued step first,
    oldest first, and a scheduler's kill 30 s after its SIGTERM would have come before step 8
    reached the remote tier. The older steps stay in the local tier for the next manager."""
    remote = tmp_path / "remote"
    env = {**ENV, "SLOW_UPLOAD": "4"}
    cmd = [sys.executable, str(WORKER), str(tmp_path), "200", "--every", "2", "--remote", str(remote)]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: _progress(tmp_path) >= 7, "step 7")
        p.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=90)
        took = time.monotonic() - t0
    finally:
        p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err[-3000:]
    at = int(err.split("preempted by SIGTERM: step ")[1].split()[0])
    assert (remote / f"step-{at:08d}" / "manifest.json").is_file(), err[-3000:]
    assert took < 12.5, (took, err[-3000:])  # two uploads at most (one begun, the last step), not four
    assert "is uploaded when a manager opens" in err, err[-3000:]
    with stashpoint.CheckpointManager(tmp_path / "ckpt", remote_root=remote) as mgr:  # the catch-up
        mgr.wait()
        assert set(mgr.remote_steps()) >= {s for s in mgr.steps() if s <= at}
