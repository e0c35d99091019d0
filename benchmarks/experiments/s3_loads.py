"""Loads from S3 (a SeaweedFS server this script starts) by two versions of stashpoint, alternated.

    python -m benchmarks.experiments.s3_loads --src OLD/src NEW/src [--size-gb 0.5] [--trials 4]

Saves a state of 128 tensors once (with the last ``--src``), then for each trial loads it in a
fresh process per ``--src`` (``PYTHONPATH``), three loads each, and prints the best of the three.
Check out the older commit with ``git worktree add /tmp/old <commit>``. It measured the bounded,
streamed ranged GETs against the whole-range GETs before them (RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_SAVE = """
import sys, torch, stashpoint
n = int(sys.argv[1])
g = torch.Generator().manual_seed(0)
stashpoint.save({f"w{i}": torch.randn(n, generator=g) for i in range(128)}, "s3://bench/ck")
"""
_LOAD = """
import sys, time, torch, stashpoint
n = int(sys.argv[1])
state = {f"w{i}": torch.empty(n) for i in range(128)}
times = []
for _ in range(3):
    t0 = time.perf_counter()
    stashpoint.load(state, "s3://bench/ck")
    times.append(time.perf_counter() - t0)
print(min(times))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", nargs="+", required=True, help="src directories of the versions to compare")
    ap.add_argument("--size-gb", type=float, default=0.5)
    ap.add_argument("--trials", type=int, default=4)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    from s3_server import SeaweedServer

    n = int(args.size_gb * 1e9 / 4 / 128)
    server = SeaweedServer(Path(tempfile.mkdtemp(prefix="s3-loads-", dir="/var/tmp")), ["bench"])
    server.start()
    try:
        with server.applied_env():
            env = dict(os.environ)
        run = [sys.executable, "-c"]
        subprocess.run([*run, _SAVE, str(n)], env={**env, "PYTHONPATH": args.src[-1]}, check=True)
        best: dict[str, list[float]] = {src: [] for src in args.src}
        for _ in range(args.trials):
            for src in args.src:
                out = subprocess.run(
                    [*run, _LOAD, str(n)], env={**env, "PYTHONPATH": src}, check=True, capture_output=True, text=True
                )
                best[src].append(round(float(out.stdout.strip()), 3))
        print(json.dumps(best, indent=1))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
