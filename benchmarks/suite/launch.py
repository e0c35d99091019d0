"""Start a worker on 1 or N ranks of this machine and collect each rank's result.

Every rank is its own process in its own session (process group), so that a timeout or a failed
peer rank kills it together with the writer processes it started. On several ranks the workers
get ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and ``OMP_NUM_THREADS=1`` (two ranks on two cores);
on one rank only the rendezvous address (for methods that need a one-rank process group).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .common import REPO

GRACE_S = 30.0  # after one rank failed, how long the others get before they are killed


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _kill_group(p: subprocess.Popen[bytes]) -> None:
    """SIGKILL the worker's process group (the worker and any process it started)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)


def launch(worker_args: list[str], world: int, results: Path, tag: str, timeout: float) -> list[dict[str, Any]]:
    """Run ``python -m benchmarks.suite.worker WORKER_ARGS`` on ``world`` ranks; each rank's result.

    A rank that fails or runs past ``timeout`` seconds gets a result with ``"error"``.
    """
    port = _free_port()
    procs: list[subprocess.Popen[bytes]] = []
    files = [results / f"{tag}-rank{r}.json" for r in range(world)]
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if world > 1:
            env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        else:
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
                env.pop(k, None)
        files[rank].unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "benchmarks.suite.worker", *worker_args, "--result", str(files[rank])]
        procs.append(
            subprocess.Popen(cmd, cwd=REPO, env=env, stdout=sys.stderr, stderr=sys.stderr, start_new_session=True)
        )
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    reason = None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = now  # a rank died: the others are likely stuck in a collective
            if now > deadline or (failed_at is not None and now > failed_at + GRACE_S):
                reason = (
                    f"timed out after {timeout:.0f} s (raise --timeout)" if now > deadline else "a peer rank failed"
                )
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            _kill_group(p)  # stragglers: timed-out ranks, writer processes left behind
            p.wait()
    out = []
    for rank, (p, f) in enumerate(zip(procs, files, strict=True)):
        res: dict[str, Any] = json.loads(f.read_text()) if f.is_file() else {}
        f.unlink(missing_ok=True)
        if "error" not in res and (p.returncode != 0 or not res):
            res["error"] = f"rank {rank} exited with status {p.returncode}" + (f" ({reason})" if reason else "")
        out.append(res)
    return out
