"""What ``stashpoint import`` spends checking a file's pickles before torch unpickles them.

    python -m benchmarks.experiments.import_scan [--tensors 10000] [--repeats 3]

A ``torch.save`` file and a DCP checkpoint (``dcp.save``, one process) of a state of
``--tensors`` small tensors (a model's state dict and its AdamW state, as a mixture of experts
holds them). For each: the scan of its pickles alone (``importcheck.check_torch_file``, and for
DCP every pickle the import scans), ``torch.load(weights_only=True, mmap=True)`` or
``dcp.load`` of the same, and the whole ``import_checkpoint``. Medians of ``--repeats``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _median(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _state(n: int) -> dict[str, Any]:
    import torch

    params = {f"layers.{i // 4}.expert{i % 4}.weight": torch.randn(16, 8) for i in range(n // 3)}
    moments = {
        i: {"step": torch.tensor(1.0), "exp_avg": torch.randn(16, 8), "exp_avg_sq": torch.rand(16, 8)}
        for i in range(len(params))
    }
    return {"model": params, "optim": {"state": moments, "param_groups": [{"lr": 1e-3, "params": list(moments)}]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import torch
    import torch.distributed.checkpoint as dcp

    from stashpoint._tools import picklescan
    from stashpoint._tools.convert import import_checkpoint
    from stashpoint._tools.importcheck import check_torch_file

    state = _state(args.tensors)
    count = len(state["model"]) + 3 * len(state["optim"]["state"])
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        torch.save(state, root / "ck.pt")
        dcp.save(state, checkpoint_id=str(root / "dcp"), no_dist=True)
        n = [0]

        def imported(src: str) -> None:
            picklescan._scan_small.cache_clear()  # each import scans anew, as a new process would
            n[0] += 1
            import_checkpoint(root / src, root / f"out-{n[0]}")

        def dcp_loaded() -> None:
            dcp.load(_state(args.tensors), checkpoint_id=str(root / "dcp"), no_dist=True)

        def unscanned(src: str) -> None:  # the same import with the scans of its pickles skipped
            saved, picklescan.scan = picklescan.scan, lambda source: None
            try:
                imported(src)
            finally:
                picklescan.scan = saved

        rows = [
            ("torch.save file: scan of its pickles", _median(
                lambda: check_torch_file(root / "ck.pt", "ck"), args.repeats)),
            ("torch.load(weights_only=True, mmap=True)", _median(
                lambda: torch.load(root / "ck.pt", weights_only=True, mmap=True), args.repeats)),
            ("stashpoint import of the torch.save file", _median(lambda: imported("ck.pt"), args.repeats)),
            ("  the same with no scan", _median(lambda: unscanned("ck.pt"), args.repeats)),
            ("dcp.load into a state of the same structure", _median(dcp_loaded, args.repeats)),
            ("stashpoint import of the DCP checkpoint", _median(lambda: imported("dcp"), args.repeats)),
            ("  the same with no scan", _median(lambda: unscanned("dcp"), args.repeats)),
        ]  # fmt: skip
    print(f"{count} tensors; medians of {args.repeats}")
    for what, seconds in rows:
        print(f"  {what:<48} {seconds:7.3f} s")


if __name__ == "__main__":
    main()
