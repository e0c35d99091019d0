from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stashpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _quiet_engine():
    """Each test starts with no save in flight from a previous test."""
    from stashpoint import _save

    _save.wait_all()
    yield
    _save.wait_all()


def run_python(code: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh Python process (the real thing: no shared module state)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + str(ROOT / "tests")}
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def small_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def train_steps(model: torch.nn.Module, optim: torch.optim.Optimizer, n: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(4, 8, generator=g)
        model(x).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()


__all__ = ["ROOT", "run_python", "small_model", "stashpoint", "train_steps"]
