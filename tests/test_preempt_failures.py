"""Preemption when something else goes wrong: a save in flight that fails, a signal that reaches
the whole process group (the writer process too), another save of the process in flight, a
signal after the last safe point with a failed save. Each is a real signal to a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import ROOT

ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}


def _run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter in a session of its own (a signal to its process group
    reaches nothing of the test's)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=ENV,
        start_new_session=True,
    )


def _committed(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*") if (p / "manifest.json").is_file())


FLAKY = """
import os, signal, sys, threading, time, torch
import stashpoint
from stashpoint._storage.local import LocalStorage

gate = threading.Event()
class FullOnce(LocalStorage):  # the save in flight meets a full disk; the disk is fine again after
    def open_writer(self, name, size):
        gate.wait(5)
        raise OSError(28, "No space left on device")

state = {"w": torch.arange(1000, dtype=torch.float32)}
mgr = stashpoint.CheckpointManager(sys.argv[1], every_steps=1000, preemption_deadline=30)
mgr.save(1, state).wait()
mgr.storage_class = FullOnce
mgr.save(2, state)
mgr.storage_class = LocalStorage
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
gate.set()
"""


def test_a_save_in_flight_that_fails_does_not_cancel_the_emergency_save(tmp_path):
    root = tmp_path / "ck"
    p = _run(FLAKY + "mgr.maybe_save(3, state)\nprint('NOT REACHED')\n", str(root))
    assert p.returncode == 128 + signal.SIGTERM, p.stdout + p.stderr
    assert "saving step 3 anyway" in p.stderr and "No space left on device" in p.stderr, p.stderr
    assert "step 3 committed" in p.stderr, p.stderr
    assert _committed(root) == [1, 3]


def test_a_signal_after_the_last_safe_point_ends_the_program_at_close_even_when_a_save_failed(tmp_path):
    root = tmp_path / "ck"
    code = (
        FLAKY
        + """
time.sleep(0.5)
try:
    mgr.close()
except stashpoint.CheckpointError as e:
    print("close raised", e, flush=True)
print("STILL RUNNING", flush=True)
"""
    )
    p = _run(code, str(root))
    assert p.returncode == -signal.SIGTERM, p.stdout + p.stderr
    assert "STILL RUNNING" not in p.stdout, "the signal was swallowed by the failed save"
    assert _committed(root) == [1]


def test_a_signal_to_the_whole_process_group_leaves_the_writer_process_writing(tmp_path):
    """A scheduler signals every process of the job, the writer process included, while it
    writes step 2 (it is held between two files, so the signal lands mid-write): it must live
    on, step 2 commit, and the safe point save step 3."""
    root = tmp_path / "ck"
    code = """
    import os, signal, sys, time, torch
    import stashpoint
    from stashpoint._save import writerproc

    root = sys.argv[1]
    with stashpoint.CheckpointManager(root, every_steps=1000, writer="process", preemption_deadline=60) as mgr:
        mgr.save(1, {"w": torch.zeros(10)}).wait()
        pid = writerproc.current_pid()
        step2 = os.path.join(root, "step-00000002")
        state = {f"t{i:03d}": torch.full((1 << 18,), float(i)) for i in range(96)}
        mgr.save(2, state, max_shard_bytes=1 << 20)
        while not (os.path.isdir(step2) and any(n.startswith("shard-") for n in os.listdir(step2))):
            time.sleep(0.0005)
        os.kill(pid, signal.SIGSTOP)
        os.killpg(os.getpgid(0), signal.SIGTERM)  # reaches the stopped writer when it goes on
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.3)
        print("writer alive:", writerproc.current_pid() == pid, flush=True)
        mgr.maybe_save(3, state)
        print("NOT REACHED", flush=True)
    """
    p = _run(code, str(root))
    assert "writer alive: True" in p.stdout, p.stdout + p.stderr
    assert p.returncode == 128 + signal.SIGTERM, p.stdout + p.stderr
    assert "step 3 committed" in p.stderr, p.stderr
    assert _committed(root) == [1, 2, 3]


def test_the_emergency_save_waits_for_another_save_of_the_process_even_with_on_busy_skip(tmp_path):
    root, other = tmp_path / "ck", tmp_path / "ema"
    code = """
    import os, signal, sys, threading, torch
    import stashpoint
    from stashpoint._storage.local import LocalStorage

    gate = threading.Event()
    class Slow(LocalStorage):  # another save of the process, still writing at the signal
        def open_writer(self, name, size):
            gate.wait(30)
            return super().open_writer(name, size)

    with stashpoint.CheckpointManager(sys.argv[1], every_steps=1000, on_busy="skip", preemption_deadline=60) as mgr:
        mgr.save(1, {"w": torch.ones(4)}).wait()
        stashpoint.async_save({"ema": torch.ones(4)}, Slow(sys.argv[2]))
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Timer(1.0, gate.set).start()
        mgr.maybe_save(2, {"w": torch.ones(4)})
    """
    p = _run(code, str(root), str(other))
    assert p.returncode == 128 + signal.SIGTERM, p.stdout + p.stderr
    assert "skipped the save" not in p.stderr, p.stderr
    assert _committed(root) == [1, 2], p.stderr
