"""Accelerate's ``save_state`` against stashpoint's adapter on the same training loop (issue 20).

    python -m benchmarks.bench_accelerate [--width 2048] [--layers 4] [--steps 40] [--every 10] [--repeat 2]

One training loop per method, prepared by a real ``Accelerator`` on the CPU, with the same
model (``--layers`` Linear(width, width) layers; with AdamW's two moments the checkpoint is ~12
bytes per parameter), data and schedule: a save every ``--every`` steps to a new directory, and a
loop without saves as the baseline. Per method, over ``--repeat`` runs (the best of each):

- **blocked per save**: how long the save call held the loop (median);
- **lost per save**: (loop time - the baseline's) / saves, once every save is durable (for
  stashpoint: committed; ``Accelerator.save_state`` writes without fsync, so its files may
  still be in the page cache): what training really lost, background writes included;
- **save to durable**: stashpoint's time from the call to the commit (median), for the
  record; ``save_state`` returns when written.
"""

from __future__ import annotations

import argparse
import shutil
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
    t0 = time.perf_counter()
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
    durable = [h.wait().total_s for h in handles]
    took = time.perf_counter() - t0
    shutil.rmtree(root / method, ignore_errors=True)
    return took, blocked, durable


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
    best: dict[str, tuple[float, list[float], list[float]]] = {}
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        run("none", args, Path(tmp))  # warm-up: imports, allocator, page cache
        for _ in range(args.repeat):  # interleaved, so that the machine's drift touches every method alike
            for m in methods:
                res = run(m, args, Path(tmp))
                if m not in best or res[0] < best[m][0]:
                    best[m] = res
    saves = args.steps // args.every
    base = best["none"][0]
    print(
        f"{params / 1e6:.1f} M parameters, checkpoint ~{params * 12 / 1e6:.0f} MB (weights + AdamW), "
        f"{args.steps} steps, a save every {args.every} ({saves} saves); best of {args.repeat}"
    )
    print("| method | loop time | blocked per save (median) | lost per save | save to durable | vs stashpoint (lost) |")
    print("|---|---:|---:|---:|---:|---:|")
    lost = {m: max(0.0, (best[m][0] - base) / saves) for m in methods[1:]}
    for m in methods:
        took, blocked, durable = best[m]
        if m == "none":
            print(f"| no checkpoints | {took:.2f} s | - | - | - | - |")
            continue
        ratio = lost[m] / lost["stashpoint"] if lost["stashpoint"] > 0 else float("inf")
        dur = f"{_median(durable) * 1000:.0f} ms" if durable else "(no fsync)"
        held = _median(blocked) * 1000
        print(f"| {m} | {took:.2f} s | {held:.0f} ms | {lost[m] * 1000:.0f} ms | {dur} | {ratio:.1f}x |")


if __name__ == "__main__":
    main()
