"""What a process's first save of many small tensors spends in Python's garbage collector.

    python -m benchmarks.experiments.first_save_gc [--params 10000] [--floats 64]

The state of ``many_tensors_durable`` (``--params`` parameters of ``--floats`` floats with
AdamW). Two ``stashpoint.save`` calls of it in one process (the first plans the structure,
the second reuses the plan), each timed until durable, with every collection's generation,
duration and thread recorded through ``gc.callbacks``; then the objects the first save left
tracked by the collector (what every later full collection of the process walks), by type.
"""

from __future__ import annotations

import argparse
import collections
import gc
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.experiments.many_tensors_durable import _build


def _kinds() -> collections.Counter[str]:
    """The objects the collector tracks, by module and class (a class's ``__module__`` may be
    a descriptor: shown as text)."""
    return collections.Counter(f"{type(o).__module__!s}.{type(o).__qualname__!s}" for o in gc.get_objects())


def _timed_save(state: Any, path: Path) -> tuple[float, dict[tuple[int, str], list[float]]]:
    """Seconds until durable, and (generation, thread) -> [collections, seconds]."""
    import stashpoint

    started: dict[int, float] = {}
    spent: dict[tuple[int, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])

    def watch(phase: str, info: dict[str, Any]) -> None:
        me = threading.get_ident()
        if phase == "start":
            started[me] = time.perf_counter()
            return
        entry = spent[(info["generation"], threading.current_thread().name)]
        entry[0] += 1
        entry[1] += time.perf_counter() - started.pop(me, time.perf_counter())

    gc.callbacks.append(watch)
    try:
        t0 = time.perf_counter()
        stashpoint.save(state, path)
        return time.perf_counter() - t0, dict(spent)
    finally:
        gc.callbacks.remove(watch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=10_000)
    ap.add_argument("--floats", type=int, default=64)
    args = ap.parse_args()
    import torch

    import stashpoint

    model, optim = _build(args.params, args.floats, fill=True)
    state = {"model": model, "optim": optim}
    with tempfile.TemporaryDirectory() as d:
        stashpoint.save({"warm": torch.ones(3)}, Path(d, "warm"))  # imports and threads, not the structure
        gc.collect()
        before = _kinds()
        print(f"objects tracked before: {sum(before.values())}")
        for name in ("first", "second"):
            seconds, spent = _timed_save(state, Path(d, name))
            in_gc = sum(s for _, s in spent.values())
            print(f"{name} save until durable: {seconds:.3f} s, of it in collections {in_gc:.3f} s")
            for (gen, thread), (n, s) in sorted(spent.items()):
                print(f"  generation {gen} on {thread}: {n} collection(s), {s:.3f} s")
            if name == "first":
                gc.collect()
                kept = _kinds() - before
                print(f"objects the first save left tracked: {sum(kept.values())}")
                for kind, n in kept.most_common(10):
                    print(f"  {n:7d} {kind}")


if __name__ == "__main__":
    main()
