"""Exact resume: 2N steps straight == N steps, async_save, fresh process, load, N steps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("resume_train.py")


def _run(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env, check=False
    )
    assert r.returncode == 0, r.stderr[-3000:]


def _assert_bitwise_equal(a, b, where="") -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_bitwise_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_bitwise_equal(x, y, f"{where}/{i}")
    else:
        assert a == b, where


@pytest.mark.slow  # the default tier: the demo's kill-and-resume and the stacks
def test_exact_resume_in_a_fresh_process(tmp_path):
    n = 15  # 96 samples / batch 8 = 12 steps per epoch: the resume crosses an epoch boundary
    _run("straight", str(tmp_path / "straight.pt"), str(n))
    _run("first", str(tmp_path / "ckpt"), str(n))
    _run("resume", str(tmp_path / "ckpt"), str(tmp_path / "resumed.pt"), str(n))
    straight = torch.load(tmp_path / "straight.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert straight["step"] == resumed["step"] == 2 * n
    _assert_bitwise_equal(straight, resumed)
    assert (tmp_path / "ckpt" / "manifest.json").exists()


@pytest.mark.slow  # the default tier: the demo's kill-and-resume, the stacks, the manager's tests
def test_exact_resume_through_the_manager(tmp_path):
    n = 15
    _run("straight", str(tmp_path / "straight.pt"), str(n))
    _run("managed", str(tmp_path / "run"), str(tmp_path / "part.pt"), str(n), "17")  # stops at 17, saved 15
    _run("managed", str(tmp_path / "run"), str(tmp_path / "resumed.pt"), str(n))  # resumes at 15
    straight = torch.load(tmp_path / "straight.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert torch.load(tmp_path / "part.pt", weights_only=True)["step"] == 17
    _assert_bitwise_equal(straight, resumed)
