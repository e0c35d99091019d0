"""Cold loads in one process: a checkpoint saved once, its pages evicted before each load.

    python -m benchmarks.experiments.cold_loads [--size-gb 0.65] [--repeats 4]

Saves the suite's GPT + AdamW state once, then alternates ``stashpoint.load`` (plain) and
``stashpoint.load(atomic=True)``, each after evicting the checkpoint's pages; prints the medians
and every trial. Run it at two commits, alternately, to compare them (how the bounce buffers'
huge pages were measured: RESULTS.md, "Huge pages for direct I/O").
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import stashpoint
from benchmarks.suite.common import evict_cache
from benchmarks.suite.state import build, choose_shape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=float, default=0.65)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--dir", default="/var/tmp", help="scratch base (default /var/tmp)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    state = build("single", choose_shape(args.size_gb), 0)
    base = Path(tempfile.mkdtemp(prefix="stashpoint-cold-loads-", dir=args.dir))
    try:
        path = base / "ckpt"
        stashpoint.save(state, path)
        times: dict[str, list[float]] = {"plain": [], "atomic": []}
        for _ in range(args.repeats):
            for kind, got in times.items():
                evict_cache(path)
                time.sleep(0.5)
                t0 = time.perf_counter()
                stashpoint.load(state, path, atomic=kind == "atomic")
                got.append(time.perf_counter() - t0)
        for kind, got in times.items():
            print(f"{kind}: {statistics.median(got):.3f} s (trials {', '.join(f'{t:.3f}' for t in got)})")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
