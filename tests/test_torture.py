"""Crash torture: a process saving checkpoints in a loop is SIGKILLed at random moments.

After every kill a new manager opens the root: the newest committed step is at least the last
one reported committed (no checkpoint lost), every listed step verifies and loads with the values
it was saved with (no corruption missed), and no leftover of the killed save remains.

The default run does a few trials (4 + 1); the slow tier (200 + 100) (``bash scripts/test.sh -m slow``) does
hundreds. Set STASHPOINT_TORTURE_REPORT=path.json to record the figures (docs/GUARANTEES.md).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import stashpoint
from dist_util import ROOT, WORKER, free_port

CHILD = Path(__file__).with_name("manager_child.py")
MB = 8


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def _check_root(root: Path, last_reported: int, numel: int, extra: bool) -> dict[str, int]:
    with stashpoint.CheckpointManager(root, keep_last=2) as mgr:
        latest = mgr.latest_step()
        assert latest is not None and latest >= last_reported, f"lost: latest {latest} < reported {last_reported}"
        leftovers = [d for d in root.glob("step-*") if not (d / "manifest.json").exists()]
        assert not leftovers, f"leftovers not removed: {leftovers}"
        for step in mgr.steps():
            report = stashpoint.verify(mgr.path(step))
            assert report.ok, report.problems
            out = {"w": torch.zeros(numel), "step": 0} | ({"b": torch.zeros(1000)} if extra else {})
            stashpoint.load(out, mgr.path(step))
            assert out["step"] == step and bool((out["w"] == step).all()), f"step {step} holds other data"
            assert not extra or bool((out["b"] == -step).all())
        return {"steps_checked": len(mgr.steps()), "latest": latest}


def _record(name: str, figures: dict[str, int]) -> None:
    path = os.environ.get("STASHPOINT_TORTURE_REPORT")
    if path:
        doc = json.loads(Path(path).read_text()) if Path(path).exists() else {}
        doc[name] = figures
        Path(path).write_text(json.dumps(doc, indent=2))


def _single_rank(tmp_path: Path, trials: int, seed: int) -> None:
    rng = random.Random(seed)
    root = tmp_path / "run"
    figures = {"trials": 0, "kills": 0, "steps_verified": 0}  # any lost or corrupt checkpoint fails the test
    for _ in range(trials):
        proc = subprocess.Popen(
            [sys.executable, str(CHILD), "crash", str(root), str(MB)], stdout=subprocess.PIPE, text=True, env=_env()
        )
        assert proc.stdout is not None
        reported: list[int] = []
        first = proc.stdout.readline()
        assert first.startswith("committed"), first
        reported.append(int(first.split()[1]))
        deadline = time.monotonic() + rng.uniform(0.0, 0.5)  # kill somewhere in a later save
        os.set_blocking(proc.stdout.fileno(), False)
        while time.monotonic() < deadline:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        rest = proc.stdout.read() or ""
        reported += [int(ln.split()[1]) for ln in rest.splitlines() if ln.startswith("committed")]
        checked = _check_root(root, max(reported), MB * 1024 * 1024 // 4, extra=True)
        figures["trials"] += 1
        figures["kills"] += 1
        figures["steps_verified"] += checked["steps_checked"]
    _record(f"single_rank_{trials}", figures)


def test_crash_torture_single_rank(tmp_path):
    _single_rank(tmp_path, trials=4, seed=1)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_crash_torture_single_rank_hundreds(tmp_path):
    _single_rank(tmp_path, trials=200, seed=2)


def _two_ranks(tmp_path: Path, trials: int, seed: int) -> None:
    rng = random.Random(seed)
    root = tmp_path / "run"
    figures = {"trials": 0, "kills": 0, "steps_verified": 0}  # any lost or corrupt checkpoint fails the test
    for _ in range(trials):
        port = free_port()
        procs = []
        for rank in range(2):
            env = {
                **_env(),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "OMP_NUM_THREADS": "1",
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), "torture_loop", str(root)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
            )
        out0 = procs[0].stdout
        assert out0 is not None
        first = out0.readline()
        assert first.startswith("committed"), first
        time.sleep(rng.uniform(0.0, 0.5))
        procs[1].send_signal(signal.SIGKILL)  # one rank dies; the other must fail its save and exit
        rest, _ = procs[0].communicate(timeout=120)
        procs[1].wait()
        reported = [int(first.split()[1])] + [
            int(ln.split()[1]) for ln in rest.splitlines() if ln.startswith("committed")
        ]
        assert "RESULT" in rest, "the surviving rank did not report the failed save"
        checked = _check_root(root, max(reported), 256 * 1024, extra=False)
        figures["trials"] += 1
        figures["kills"] += 1
        figures["steps_verified"] += checked["steps_checked"]
    _record(f"two_ranks_{trials}", figures)


def test_crash_torture_two_ranks_one_killed(tmp_path):
    _two_ranks(tmp_path, trials=1, seed=3)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_crash_torture_two_ranks_many(tmp_path):
    _two_ranks(tmp_path, trials=100, seed=4)
