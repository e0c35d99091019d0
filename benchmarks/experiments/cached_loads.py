"""Cached loads in one process, phase by phase: what a load adds to the bytes when the page
cache holds them (a process restarted on the same node).

    python -m benchmarks.experiments.cached_loads [--size-gb 0.65] [--repeats 8]

Saves the suite's GPT + AdamW state once and reads its files whole, so that every page is
cached. Then: the parse of the manifest and of the rank's index alone (medians of 20), and
``stashpoint.load`` with ``verify=True`` and ``verify=False``, alternated, each split into its
planning (``loader._plan``: the manifest, the index, the plan) and its reads (``_read``: read,
check and place every byte), with a raw read of the same files into memory of its own for
reference. Run it at two commits, alternately, to compare them (how the parse and the
checks-as-read of 2026-12-05 were measured: RESULTS.md).
"""

from __future__ import annotations

import argparse
import functools
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import stashpoint
from benchmarks.suite.state import build, choose_shape
from stashpoint._core.index import Head, parse_head, parse_index
from stashpoint._load import loader


def _median_ms(times: list[float]) -> str:
    return f"{statistics.median(times) * 1e3:.1f} ms"


def _timed(into: dict[str, list[float]], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.setdefault(name, []).append(time.perf_counter() - t0)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=float, default=0.65)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--dir", default="/var/tmp", help="scratch base (default /var/tmp)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    state = build("single", choose_shape(args.size_gb), 0)
    base = Path(tempfile.mkdtemp(prefix="stashpoint-cached-loads-", dir=args.dir))
    try:
        path = base / "ckpt"
        stashpoint.save(state, path)
        files = sorted(p for p in path.rglob("*") if p.is_file())
        whole = memoryview(bytearray(sum(f.stat().st_size for f in files)))
        raw_read = _raw_reader(files, whole)
        raw_read()  # every page cached, and the memory of its own touched

        raw = (path / "manifest.json").read_bytes()
        head = parse_head(raw, "manifest")
        assert isinstance(head, Head)
        index = (path / head.index_name(0)).read_bytes()
        parses: dict[str, Callable[[], Any]] = {
            "parse_head": lambda: parse_head(raw, "m"),
            "parse_index": lambda: parse_index(index, "i", head, 0),
        }
        for name, fn in parses.items():
            ts = []
            for _ in range(20):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            print(f"{name}: {_median_ms(ts)} ({len(head.catalog)} tensors)")

        phases: dict[str, dict[str, list[float]]] = {"verify": {}, "no verify": {}, "raw read": {}}
        originals = {n: getattr(loader, n) for n in ("_plan", "_read")}
        try:
            for _ in range(args.repeats):
                for kind, got in phases.items():
                    for n, fn in originals.items():
                        setattr(loader, n, _timed(got, n, fn))
                    t0 = time.perf_counter()
                    if kind == "raw read":
                        raw_read()
                    else:
                        stashpoint.load(state, path, verify=kind == "verify")
                    got.setdefault("total", []).append(time.perf_counter() - t0)
        finally:
            for n, fn in originals.items():
                setattr(loader, n, fn)
        for kind, got in phases.items():
            parts = ", ".join(f"{n} {_median_ms(ts)}" for n, ts in got.items() if n != "total")
            print(f"{kind}: {_median_ms(got['total'])}" + (f" ({parts})" if parts else ""))
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _raw_reader(files: list[Path], into: memoryview) -> Callable[[], None]:
    def read() -> None:
        pos = 0
        for f in files:
            with f.open("rb", buffering=0) as fh:
                while n := fh.readinto(into[pos:]):
                    pos += n

    return read


if __name__ == "__main__":
    main()
