from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import stashpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _quiet_engine():
    """Each test starts with no save in flight from a previous test."""
    from stashpoint._save import engine as _save

    _save.wait_all()
    yield
    _save.wait_all()


# -- S3: a real SeaweedFS server (tests/s3_server.py) ------------------------------------------

S3_BUCKET = "stashpoint-test"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One ``weed mini`` S3 server for the session (started on first use, stopped with SIGINT)."""
    from s3_server import SeaweedServer

    server = SeaweedServer(tmp_path_factory.mktemp("s3"), [S3_BUCKET])
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server):
    """The AWS_* variables of the session server, for this test and the processes it starts."""
    with s3_server.applied_env():
        yield s3_server


@pytest.fixture
def s3_url(s3_env, request) -> str:
    """A fresh prefix in the session bucket for this test."""
    import re
    import uuid

    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)[:60]
    return f"s3://{S3_BUCKET}/{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def s3_own_server(tmp_path):
    """A server of this test's own, for destructive tests (stopped, killed, restarted)."""
    from s3_server import SeaweedServer

    server = SeaweedServer(tmp_path / "s3", [S3_BUCKET])
    server.start()
    try:
        with server.applied_env():
            yield server
    finally:
        server.stop(timeout=5)  # its data is thrown away: no need to wait long for a clean stop


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


__all__ = ["ROOT", "S3_BUCKET", "run_python", "small_model", "stashpoint", "train_steps"]


# -- format versions ---------------------------------------------------------------------------


def to_v1(ck: Path) -> Path:
    """Rewrite the (version-2) checkpoint at ``ck`` as format version 1 would have held it: one
    manifest listing every chunk, no indexes. For the tests of version-1 rules and loads."""
    from stashpoint._core.naming import MANIFEST_NAME
    from stashpoint._load.manifest import read_manifest
    from stashpoint._storage import storage_for

    whole = read_manifest(storage_for(ck))
    (ck / MANIFEST_NAME).write_bytes(whole.to_json())
    for name, _ in whole.indexes:
        (ck / name).unlink()
    return ck


def v1_doc(ck: Path) -> dict:
    """The version-1 manifest document of the checkpoint at ``ck`` (rewritten as version 1)."""
    import json

    from stashpoint._core.naming import MANIFEST_NAME

    return json.loads((to_v1(ck) / MANIFEST_NAME).read_bytes())


def index_doc(ck: Path, rank: int = 0) -> tuple[Path, dict]:
    """The path and document of ``rank``'s index in the version-2 checkpoint at ``ck``."""
    import json

    (path,) = ck.glob(f"index-r{rank:05d}-*.json")
    return path, json.loads(path.read_bytes())


def reseal_index(ck: Path, path: Path, doc: dict) -> None:
    """Write a changed index ``doc`` at ``path`` sealed, and re-seal the manifest to name it:
    what an attacker who knows the format can do."""
    import json

    from stashpoint._core.format import checksum, seal
    from stashpoint._core.naming import MANIFEST_NAME, parse_save_file

    raw = seal(doc)
    path.write_bytes(raw)
    head = json.loads((ck / MANIFEST_NAME).read_bytes())
    parsed = parse_save_file(path.name)
    assert parsed is not None
    head["indexes"][parsed[0]] = [len(raw), checksum(raw)]
    (ck / MANIFEST_NAME).write_bytes(seal(head))


def whole(ck: Path):
    """The whole checkpoint at ``ck`` as one Manifest (every index read, for version 2)."""
    from stashpoint._load.manifest import read_manifest
    from stashpoint._storage import storage_for

    return read_manifest(storage_for(ck))


def read_losses(d: Path, rank: int = 0) -> dict[int, float]:
    """Loss per step from ``d/losses-<rank>.jsonl`` (lines of {"step", "loss"}) as the training
    workers write it; a step run again after a resume replaces the first run's entry."""
    out: dict[int, float] = {}
    for line in (d / f"losses-{rank}.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


def first_step_from(path: Path, line: int) -> int:
    """The step of line ``line`` of a losses log: the first a resumed run wrote, when ``line`` is
    how many the killed run left. A run that started over (no checkpoint found) logs its first."""
    return int(json.loads(path.read_text().splitlines()[line])["step"])


def log_lines(path: Path) -> int:
    """How many lines ``path`` holds so far (0 before it exists)."""
    return len(path.read_text().splitlines()) if path.exists() else 0


def sigkill_once(proc: subprocess.Popen, ready: Callable[[], bool], timeout: float = 120.0) -> None:
    """``kill -9`` ``proc`` as soon as ``ready()`` holds; fail if it ends before that."""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None and not ready():
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test skipped without a CUDA device ``cuda``: the GPU check runs them alone."""
    for item in items:
        if any(m.name == "skipif" and "CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers()):
            item.add_marker(pytest.mark.cuda)
