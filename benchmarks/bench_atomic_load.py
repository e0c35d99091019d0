"""What all-or-nothing loads cost: ``load(atomic=True)`` (read and verify into the load's own
buffers, then copy into the state) against ``atomic=False`` (the default: whole chunks read
straight into the state's tensors), alternating on one checkpoint, one process.

    python -m benchmarks.bench_atomic_load [--size-gb 1] [--repeats 5]

The state is a model-like mix of tensors (16 MiB to 64 KiB) plus an AdamW-like pair per tensor.
Prints each mode's median load time and the ratio; every load is checked bitwise.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time

import torch

import stashpoint


def _state(size_gb: float) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    total, i = int(size_gb * 1e9), 0
    sizes = [4 << 20, 1 << 20, 256 << 10, 16 << 10]  # elements: 16 MiB .. 64 KiB of float32
    while sum(t.numel() * 4 for t in out.values()) < total:
        out[f"t{i}"] = torch.randn(sizes[i % len(sizes)])
        i += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    saved = _state(args.size_gb)
    nbytes = sum(t.numel() * 4 for t in saved.values())
    live = {k: torch.zeros_like(v) for k, v in saved.items()}
    times: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="stashpoint-atomic-", dir=".") as d:
        stashpoint.save(saved, f"{d}/ckpt")
        for atomic in (True, False):  # warm-up, not timed: the first load after the save runs slow here
            stashpoint.load(live, f"{d}/ckpt", atomic=atomic)
        for i in range(args.repeats * 2):
            atomic = i % 2 == 0
            for t in live.values():
                t.zero_()
            gc.collect()
            t0 = time.perf_counter()
            stashpoint.load(live, f"{d}/ckpt", atomic=atomic)
            times[atomic].append(time.perf_counter() - t0)
            assert all(torch.equal(live[k], saved[k]) for k in saved)
    a, b = statistics.median(times[True]), statistics.median(times[False])
    print(f"{nbytes / 1e9:.2f} GB, {len(saved)} tensors, {args.repeats} loads each (alternating):")
    print(f"  atomic=True  median {a:.3f} s  ({nbytes / a / 1e9:.2f} GB/s)  all: {[round(x, 3) for x in times[True]]}")
    print(f"  atomic=False median {b:.3f} s  ({nbytes / b / 1e9:.2f} GB/s)  all: {[round(x, 3) for x in times[False]]}")
    print(f"  all-or-nothing costs {a / b:.2f}x the load time")


if __name__ == "__main__":
    main()
