"""Launch N real processes joined in a real gloo process group (the test's own small torchrun)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("dist_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rendezvous_store() -> Any:
    """A TCP store served by this process on a free port it holds (``.port``), for processes
    that join it as clients."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)


def run_world(
    n: int, *args: str, timeout: float = 180, allow_fail: bool = False, worker: Path = WORKER
) -> list[dict]:
    """Run ``worker ARGS`` (default ``dist_worker.py``) on ``n`` ranks; return each rank's RESULT dict (or {}).

    The rendezvous store is served from this process on a port the kernel gives it and that it
    holds until the ranks are done; the ranks join it as clients (as under torchrun's agent).
    A port picked free and handed to rank 0 to bind could be taken in between by another test
    (EADDRINUSE)."""
    store = rendezvous_store()
    try:
        return _run(n, args, timeout, allow_fail, worker, store.port)
    finally:
        del store


def _run(n: int, args: tuple[str, ...], timeout: float, allow_fail: bool, worker: Path, port: int) -> list[dict]:  # noqa: PLR0917
    procs = []
    for rank in range(n):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT / "src") + os.pathsep + str(ROOT / "tests"),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",  # join the store above, do not serve one
            "RANK": str(rank),
            "WORLD_SIZE": str(n),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(worker), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    results = []
    for rank, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"rank {rank} of {args} hung for {timeout} s") from None
        if p.returncode != 0 and not allow_fail:
            raise AssertionError(f"rank {rank} of {args} exited {p.returncode}:\n{err[-3000:]}")
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        results.append(json.loads(lines[-1][7:]) if lines else {})
    return results
