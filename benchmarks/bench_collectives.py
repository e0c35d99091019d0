"""stashpoint's own collectives as the world grows: the per-step preemption agreement, group
creation, and who reads a load's replicated regions.

    python -m benchmarks.bench_collectives [--worlds 2 4 8] [--calls 200] [--ranks 16384]

Three measurements, each against what it replaced, in one run:

* **the agreement at every ``maybe_save``** (``gloo.tree_max``: a tree up to rank 0 and a
  broadcast down) against gloo's ring ``all_reduce``, ms per call, on real gloo processes of
  this host (one per rank: past two ranks they share two cores, so the figures show how each
  grows with the world, not what a cluster takes);
* **the sockets a new stashpoint group opens** per process (``gloo.gloo_group``, connecting to
  a peer at the first exchange with it) against ``new_group``'s full mesh, then after one
  broadcast on it;
* **the job store's requests a save makes** (each rank marks its arrival at a collective only
  once the collective has waited 1 s; it used to set a mark and delete an old one at every
  collective, two requests per rank per collective, all to the one store server): counted over
  ``SAVES`` saves of a small state after a first one, with the collectives they ran;
* **assigning a load's replicated regions to readers** at ``--ranks`` ranks, pure: the seconds
  and the number of readers (one broadcast each at least) for 1,000 eight-byte step counters and
  3,000 tensors of 1 MiB, the assignment before (every rank intersected R copies of the wanted
  set and scanned R ranks per item) against now.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stashpoint._core.assign import Item, assign_readers
from stashpoint._core.reshard import Box


def _sockets() -> int:
    n = 0
    for fd in Path("/proc/self/fd").iterdir():
        try:
            n += str(fd.readlink()).startswith("socket:")
        except OSError:
            pass
    return n


SAVES = 10


class _CountingStore:
    """The job's store, counting the requests made through it."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.requests = inner, 0

    def __getattr__(self, name: str) -> Any:
        real = getattr(self.inner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.requests += 1
            return real(*args, **kwargs)

        return counted


def _store_requests(root: str) -> tuple[int, int]:
    """(store requests, collectives) of this rank over ``SAVES`` saves, after a first one."""
    import stashpoint
    from stashpoint._dist import group as _group

    stashpoint.save({"w": torch.ones(1024)}, f"{root}/first")  # creates stashpoint's group
    counting = _CountingStore(_group.store())
    real, _group.store = _group.store, lambda: counting  # type: ignore[assignment]
    ctx = _group.context()
    assert ctx is not None
    calls = ctx.calls
    try:
        for i in range(SAVES):
            stashpoint.save({"w": torch.full((1024,), float(i))}, f"{root}/s{i}")
    finally:
        _group.store = real  # type: ignore[assignment]
    return counting.requests, ctx.calls - calls


def _rank(rank: int, world: int, calls: int, init: str, out: Any) -> None:
    from stashpoint._dist.gloo import gloo_group, tree_max

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    before = _sockets()
    eager = dist.new_group(backend="gloo")
    eager_sockets = _sockets() - before
    before = _sockets()
    lazy = gloo_group(lazy=True)
    lazy_sockets = _sockets() - before
    dist.broadcast(torch.ones(1), 0, group=lazy)
    lazy_after = _sockets() - before
    requests, collectives = _store_requests(init.removeprefix("file://").rpartition("/")[0])
    requests_all = [torch.tensor([requests])]
    dist.all_reduce(requests_all[0], group=eager)
    times: dict[str, list[float]] = {"all_reduce": [], "tree_max": []}
    for _ in range(calls):
        for name, spent in times.items():
            flag = torch.tensor([0, 7, -7], dtype=torch.int64)
            dist.barrier(group=eager)
            t0 = time.perf_counter()
            if name == "all_reduce":
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=eager)
            else:
                tree_max(flag, lazy)
            spent.append(time.perf_counter() - t0)
    if rank == 0:
        out.put({
            "world": world,
            **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()},
            "eager_sockets": eager_sockets,
            "lazy_sockets": lazy_sockets,
            "lazy_after_broadcast": lazy_after,
            "store_requests_per_save": int(requests_all[0]) / SAVES,
            "collectives_per_save": collectives / SAVES,
        })  # fmt: skip
    dist.destroy_process_group()


def agreement(worlds: Sequence[int], calls: int) -> list[dict[str, Any]]:
    rows = []
    ctx = mp.get_context("spawn")
    for world in worlds:
        out = ctx.Queue()
        with tempfile.TemporaryDirectory() as d:
            init = f"file://{d}/rendezvous"
            procs = [ctx.Process(target=_rank, args=(r, world, calls, init, out)) for r in range(world)]
            for p in procs:
                p.start()
            rows.append(out.get(timeout=600))
            for p in procs:
                p.join(timeout=60)
    return rows


def _readers_before(wanted: dict[Item, int], world: int) -> dict[Item, int]:
    """The assignment this replaced, as every rank ran it."""
    per_rank = [wanted] * world
    common = set(per_rank[0])
    for w in per_rank[1:]:
        common &= set(w)
    load = [0] * world
    out: dict[Item, int] = {}
    for item in sorted(common, key=lambda i: (-wanted[i], i[0], i[1].offsets, i[1].shape)):
        rank = min(range(world), key=lambda r: (load[r], r))
        out[item] = rank
        load[rank] += wanted[item]
    return out


def readers(ranks: int) -> list[dict[str, Any]]:
    small = {(f"optim/state/{i}/step", Box((), ())): 8 for i in range(1000)}
    big = {(f"model/w{i}", Box((0,), (1 << 18,))): 1 << 20 for i in range(3000)}
    rows = []
    for name, wanted in (("1,000 step counters", small), ("3,000 tensors of 1 MiB", big)):
        row: dict[str, Any] = {"regions": name}
        for how, fn in (("before", _readers_before), ("now", assign_readers)):
            t0 = time.perf_counter()
            got = fn(wanted, ranks)
            row[f"{how}_s"] = time.perf_counter() - t0
            row[f"{how}_readers"] = len(set(got.values()))
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--ranks", type=int, default=16384)
    args = ap.parse_args()
    print("| ranks | ring all_reduce | tree_max | sockets, full mesh | sockets, lazy | lazy, after a broadcast |")
    print("|---:|---:|---:|---:|---:|---:|")
    rows = agreement(args.worlds, args.calls)
    for r in rows:
        print(
            f"| {r['world']} | {r['all_reduce_ms']:.2f} ms | {r['tree_max_ms']:.2f} ms | {r['eager_sockets']} "
            f"| {r['lazy_sockets']} | {r['lazy_after_broadcast']} |"
        )
    print(f"\nthe job store's requests a save makes (all ranks; {SAVES} saves after a first):\n")
    print("| ranks | collectives a save | requests a save, marking at every collective | requests a save now |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        c = r["collectives_per_save"]
        print(f"| {r['world']} | {c:g} | {2 * c * r['world']:g} | {r['store_requests_per_save']:g} |")
    print(f"\nreaders of a load's replicated regions at {args.ranks} ranks:\n")
    print("| regions | before | readers before | now | readers now |")
    print("|---|---:|---:|---:|---:|")
    for r in readers(args.ranks):
        print(
            f"| {r['regions']} | {r['before_s']:.2f} s | {r['before_readers']} | {r['now_s'] * 1e3:.1f} ms "
            f"| {r['now_readers']} |"
        )


if __name__ == "__main__":
    main()
