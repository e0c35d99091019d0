"""The blocking call of ``async_save`` on a state of many small tensors, phase by phase.

    python -m benchmarks.experiments.many_tensors [--params 10000] [--repeats 5]

``--params`` parameters of 256 floats with AdamW (three tensors each, plus the step counts:
40k tensors for 10k parameters, like a mixture-of-experts model's many small weights). The bytes
are few, so the call's time is its per-tensor Python work: the state's flattening, the layout
(remembered per structure after the first save), the copies. Prints the call's times with and
without ``overlap``, and each phase alone (best of ``--repeats``). Run it at two commits to
compare them; on a GPU host ``benchmarks/gpu_check.py`` measures the same call on CUDA tensors.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import stashpoint
from stashpoint._save.cudacopy import stage
from stashpoint._save.engine import get_engine
from stashpoint._state.tree import flatten_with_buffers


def _best(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    params = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(256)) for _ in range(args.params))
    optim = torch.optim.AdamW(params.parameters(), lr=1e-3, foreach=True)
    for p in params:
        p.grad = torch.ones_like(p)
    optim.step()
    state = {"model": params, "optim": optim}
    scratch = Path(tempfile.mkdtemp(prefix="many-tensors-", dir="/var/tmp"))
    stashpoint.async_save(state, scratch / "warm").wait()  # the first save learns the layout

    for overlap in (False, True):
        calls = []
        for i in range(args.repeats):
            t0 = time.perf_counter()
            handle = stashpoint.async_save(state, scratch / f"s-{overlap}-{i}", overlap=overlap)
            calls.append(time.perf_counter() - t0)
            optim.step()
            handle.wait()
        print(
            f"async_save(overlap={overlap}) call: median {statistics.median(calls) * 1e3:.0f} ms "
            f"({', '.join(f'{t * 1e3:.0f}' for t in calls)})"
        )

    _, tensors, _ = flatten_with_buffers(state)
    engine = get_engine()
    targets = [torch.empty_like(t) for _, t in tensors]
    phases = {
        "flatten": lambda: flatten_with_buffers(state),
        "layout (remembered)": lambda: engine.layouts(tensors, ()),
        "copies (stage)": lambda: stage([(t, d) for (_, t), d in zip(tensors, targets, strict=True)]),
        "bare copy_ loop": lambda: [d.copy_(t.detach()) for (_, t), d in zip(tensors, targets, strict=True)],
    }
    print(f"{len(tensors)} tensors; each phase alone, best of {args.repeats}:")
    for name, fn in phases.items():
        print(f"  {name}: {_best(fn, args.repeats) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
