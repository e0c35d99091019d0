"""Two managers of different states in one process (a GAN's generator and discriminator),
saving in turn: what the generator's blocking call costs when the discriminator's saves come
between. Page faults of the training thread during the call (first touch of staging memory)
and the call's staging seconds, per save, with the pool's fresh allocations.

    python -m benchmarks.experiments.two_managers [--big-mib 128] [--small-mib 4] [--saves 6]

Run it at two commits (``PYTHONPATH=<other clone>/src``) to compare them: before 2026-12-07
the small state's save took and trimmed the large one's idle buffer, whose next save touched
all its memory again.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
from pathlib import Path

import torch

import stashpoint
from stashpoint._save.engine import current_engine


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--big-mib", type=int, default=128)
    ap.add_argument("--small-mib", type=int, default=4)
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--dir", default="/var/tmp")
    args = ap.parse_args()
    big = {"w": torch.randn(args.big_mib << 18)}  # 4-byte floats: MiB << 18 of them
    small = {"w": torch.randn(args.small_mib << 18)}
    base = Path(tempfile.mkdtemp(prefix="stashpoint-two-managers-", dir=args.dir))
    try:
        with (
            stashpoint.CheckpointManager(base / "gen", keep_last=1) as gen,
            stashpoint.CheckpointManager(base / "disc", keep_last=1) as disc,
        ):
            print("| save | generator's call: page faults | staging s | pool allocations so far |")
            print("|---:|---:|---:|---:|")
            for step in range(1, args.saves + 1):
                f0 = _faults()
                h = gen.save(step, big)
                faults = _faults() - f0
                h.wait()
                engine = current_engine()
                allocations = engine.pool.allocations if engine is not None else 0
                print(f"| {step} | {faults} | {h.stats.staging_s:.3f} | {allocations} |", flush=True)
                disc.save(step, small).wait()
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
