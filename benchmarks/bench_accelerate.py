"""Accelerate's ``save_state`` against stashpoint's adapter on the same training loop (issue 20).

    python -m benchmarks.bench_accelerate [--width 2048] [--layers 4] [--steps 40] [--every 10] [--repeat 2]

One training loop per method, prepared by a real ``Accelerator`` on the CPU, with the same
model (``--layers`` Linear(width, width) layers; with AdamW's two moments the checkpoint is ~12
bytes per parameter), data and schedule: a save every ``--every`` steps to a new directory, and a
loop without saves as the baseline. Per method, over ``--repeat`` runs (the best of each):

- **blocked per save**: how long the save call held the loop (median);
- **lost per save**: the loop's time beyond its own median step, / saves, once every save is
  durable (for stashpoint: committed; ``Accelerator.save_state`` writes without fsync, so its
  files may still be in the page cache): what training really lost, background writes'
  contention included, measured within each run (free of the drift between runs; the run
  without saves shows what that measure gives for no saves at all);
- **save to durable**: stashpoint's time from the call to the commit (median), for the
  record; ``save_state`` returns when written.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from torch.utils.data import DataLoader, TensorDataset

from stashpoint.integrations.accelerate import save_state


def run(method: str, args: argparse.Namespace, root: Path) -> tuple[float, list[float], list[float]]:
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    data = DataLoader(TensorDataset(torch.randn(args.steps * 4, args.width)), batch_size=4)
    model, opt, sched, data = acc.prepare(model, opt, sched, data)
    blocked: list[float] = []
    handles = []
    ends = [time.perf_counter()]
    for step, (x,) in enumerate(data, start=1):
        acc.backward(model(x).pow(2).mean())
        opt.step()
        sched.step()
        opt.zero_grad()
        if method != "none" and step % args.every == 0:
            path = root / method / f"step-{step}"
            t = time.perf_counter()
            if method == "stashpoint":
                handles.append(save_state(acc, path))
            else:
                acc.save_state(path)
            blocked.append(time.perf_counter() - t)
        ends.append(time.perf_counter())
    durable = [h.wait().total_s for h in handles]
    ends[-1] = time.perf_counter()  # the last save durable (stashpoint) or written
    shutil.rmtree(root / method, ignore_errors=True)
    return ends, blocked, durable


def _lost(ends: list[float]) -> float:
    """Time beyond this run's own median step: what saving cost the loop, background writes'
    contention included, free of the drift between runs on a shared machine."""
    steps = [b - a for a, b in itertools.pairwise(ends)]
    return sum(steps) - len(steps) * statistics.median(steps)


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] if xs else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    params = args.layers * (args.width * args.width + args.width)
    methods = ["none", "Accelerator.save_state", "stashpoint"]
    best: dict[str, tuple[list[float], list[float], list[float]]] = {}
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        run("none", args, Path(tmp))  # warm-up: imports, allocator, page cache
        for _ in range(args.repeat):  # interleaved, so that the machine's drift touches every method alike
            for m in methods:
                res = run(m, args, Path(tmp))
                if m not in best or _lost(res[0]) < _lost(best[m][0]):
                    best[m] = res
    saves = args.steps // args.every
    print(
        f"{params / 1e6:.1f} M parameters, checkpoint ~{params * 12 / 1e6:.0f} MB (weights + AdamW), "
        f"{args.steps} steps, a save every {args.every} ({saves} saves); best of {args.repeat}"
    )
    print("| method | median step | blocked per save (median) | lost per save | save to durable | vs stashpoint |")
    print("|---|---:|---:|---:|---:|---:|")
    lost = {m: _lost(best[m][0]) / saves for m in methods[1:]}
    for m in methods:
        ends, blocked, durable = best[m]
        step = statistics.median(b - a for a, b in itertools.pairwise(ends))
        if m == "none":
            noise = _lost(ends) / saves * 1000
            print(f"| no checkpoints | {step * 1000:.0f} ms | - | {noise:.0f} ms (noise) | - | - |")
            continue
        ratio = lost[m] / lost["stashpoint"] if lost["stashpoint"] > 0 else float("inf")
        dur = f"{_median(durable) * 1000:.0f} ms" if durable else "(no fsync)"
        held = _median(blocked) * 1000
        print(f"| {m} | {step * 1000:.0f} ms | {held:.0f} ms | {lost[m] * 1000:.0f} ms | {dur} | {ratio:.1f}x |")


if __name__ == "__main__":
    main()
