"""One method on one state, in its own process (one per rank): ``python -m benchmarks.suite.worker``.

Started by :mod:`.launch`; writes its figures as JSON to ``--result``. Phases, in order:

* ``saves``: one warm-up save (reported as "first call"), then ``--repeats`` measured saves, each
  to a fresh path (the cold regime waits ``--cold-sleep`` seconds first); per save the call
  (blocking), until the live state may change (staged), until the library reports it finished
  (written) and until durable (the harness fsyncs for libraries that do not); peak extra host
  memory over all of them;
* ``loads``: ``--repeats`` loads of the last checkpoint into the live, scrambled state after
  evicting its pages, each verified against the saved values;
* ``steps``: the training-loop experiment (:mod:`.steptime`).

After each measured save and each load, every rank writes (reads) its share of the state's
bytes with direct I/O (:class:`.disk.Paired`): the disk's speed at that moment, against which
the save's and the load's throughput are reported.

The ``reference`` method measures the raw disk and the copy floor instead (:mod:`.disk`).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .common import GB, evict_cache, fsync_tree, log, remove, tree_bytes
from .disk import Paired
from .memory import MemoryMonitor
from .methods import METHODS
from .savers import Ctx, Saver, make_loader, make_saver
from .state import build, choose_shape, data_ptrs, fingerprint, local_bytes, same_fingerprint, scramble

PHASES = ("saves", "loads", "steps")


def measure(saver: Saver, path: Path, *, fsyncs: bool, rank: int, barrier: Callable[[], None]) -> dict[str, Any]:
    """One save, timed: blocking, staged, written, durable (see the module doc)."""
    t0 = time.perf_counter()
    pending = saver.start(path)
    t1 = time.perf_counter()
    pending.wait_staged()
    t2 = time.perf_counter()
    figures = pending.wait()
    t3 = time.perf_counter()
    barrier()  # every rank's part is written
    if not fsyncs and rank == 0:
        fsync_tree(path)
    barrier()
    t4 = time.perf_counter()
    rec = {"blocking_s": t1 - t0, "staged_s": t2 - t0, "written_s": t3 - t0, "durable_s": t4 - t0, "t0": t0}
    if not fsyncs:
        rec["harness_fsync_s"] = t4 - t3
    rec.update(figures)
    return rec


def _paired(op: Callable[[], float], barrier: Callable[[], None]) -> float:
    barrier()  # every rank at once, as in the save or load just measured
    t = op()
    barrier()
    return t


def run_saves(
    saver: Saver,
    args: argparse.Namespace,
    *,
    root: Path,
    rank: int,
    barrier: Callable[[], None],
    keep_last: bool,
    paired: Paired | None = None,
) -> tuple[dict[str, Any], Path | None]:
    method = METHODS[args.method]
    records: list[dict[str, Any]] = []
    first: dict[str, Any] = {}
    kept = None
    for i in range(args.repeats + 1):
        if i > 0 and args.regime == "cold":
            time.sleep(args.cold_sleep)
        path = root / f"save-{i}"
        barrier()
        rec = measure(saver, path, fsyncs=method.fsyncs, rank=rank, barrier=barrier)
        rec["loadavg1"] = os.getloadavg()[0]
        if rank == 0:
            rec["bytes_on_disk"] = tree_bytes(path)
        log(
            f"{args.method} {args.regime} save {i}/{args.repeats}{' (warm-up)' if i == 0 else ''}: blocking "
            f"{rec['blocking_s']:.3f} s, staged {rec['staged_s']:.3f} s, durable {rec['durable_s']:.3f} s",
            "worker",
        )
        if i == 0:
            first = rec
        else:
            if paired is not None:
                rec["raw_write_s"] = _paired(paired.write, barrier)
            records.append(rec)
        barrier()
        if keep_last and i == args.repeats:
            kept = path
        elif rank == 0:
            remove(path)
        barrier()
    return {"first": first, "records": records}, kept


def run_loads(
    state: dict[str, Any],
    args: argparse.Namespace,
    ctx: Ctx,
    *,
    path: Path,
    mon: MemoryMonitor,
    barrier: Any,
    paired: Paired | None = None,
) -> list[dict[str, Any]]:
    loader = make_loader(args.method, state, ctx)
    if loader is None:
        return []
    reference = fingerprint(state)
    ptrs = data_ptrs(state)
    out = []
    same_node = args.load_regime == "same-node"
    raw_read = paired.read if paired is not None else None
    if same_node:  # a process restarted where the save ran: the cache as the save and the idle time left it
        if paired is not None:
            paired.cache()
            raw_read = paired.read_cached
        time.sleep(args.idle)
    for i in range(args.repeats):
        scramble(state)
        if ctx.rank == 0 and not same_node:
            evict_cache(path)  # the page cache is shared: one rank drops the pages for all
        barrier()
        base = mon.reset()
        rec = loader(path)
        rec["peak_extra_gb"] = (mon.peak_since_reset() - base) / GB
        rec["verified"] = same_fingerprint(fingerprint(state), reference)
        rec["in_place"] = data_ptrs(state) == ptrs
        if raw_read is not None and paired is not None and paired.file.exists():
            rec["raw_read_s"] = _paired(raw_read, barrier)
        barrier()
        log(f"{args.method} load {i + 1}/{args.repeats}: {rec['load_s']:.3f} s, verified={rec['verified']}", "worker")
        out.append(rec)
    return out


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=r".*assuming the intent is to (save|load) in a single process.*")
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    method = METHODS.get(args.method)
    timeout = _dt.timedelta(seconds=args.op_timeout)
    if world > 1 or (method is not None and method.needs_pg):
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)

    def barrier() -> None:
        if world > 1:
            dist.barrier()

    try:
        out: dict[str, Any] = {"method": args.method, "rank": rank, "world": world, "layout": args.layout}
        out["torch_threads"] = torch.get_num_threads()
        t0 = time.perf_counter()
        state = build(args.layout, choose_shape(args.size_gb), args.seed, rank, world)
        out["build_s"] = time.perf_counter() - t0
        out["local_bytes"], out["num_tensors"] = local_bytes(state)
        log(f"{args.method}: state built, {out['local_bytes'] / GB:.3f} GB in {out['build_s']:.1f} s", "worker")
        root = Path(args.dir)
        root.mkdir(parents=True, exist_ok=True)
        if args.method == "reference":
            from .disk import copy_floor, raw_bandwidth

            if args.floor:
                out["floor"] = copy_floor(state, args.repeats)
            del state
            gc.collect()
            out["disk"] = raw_bandwidth(root / "disk", out["local_bytes"], args.regime, args.repeats, args.cold_sleep)
            return out
        assert method is not None
        ctx = Ctx(rank, world, args.layout, args.op_timeout)
        share = out["local_bytes"] // (world if args.layout == "ddp" else 1)
        paired = Paired(root, rank, share, out["local_bytes"])  # allocated before the memory baseline
        gc.collect()
        mon = MemoryMonitor()
        try:
            base = mon.reset()
            out["baseline_mem_gb"] = base / GB
            out["baseline_processes"] = mon.describe_peak()
            phases = args.phases.split(",")
            kept = None
            if "saves" in phases:
                saver = make_saver(args.method, state, ctx)
                try:
                    keep = "loads" in phases and method.load is not None
                    out["saves"], kept = run_saves(
                        saver, args, root=root, rank=rank, barrier=barrier, keep_last=keep, paired=paired
                    )
                finally:
                    saver.close()
                out["saves"]["peak_extra_gb"] = (mon.peak_since_reset() - base) / GB
                out["saves"]["retained_gb"] = (mon.now() - base) / GB
                # where the peak came from: each process's memory then, and the save it came in
                out["saves"]["peak_processes"] = mon.describe_peak()
                starts = [out["saves"]["first"].get("t0", 0.0)] + [r.get("t0", 0.0) for r in out["saves"]["records"]]
                out["saves"]["peak_in_save"] = sum(1 for t in starts if t <= mon.peak_at) - 1  # 0: the warm-up
            if kept is not None:
                out["loads"] = _phase(
                    out, "loads", world, run_loads, state, args, ctx, path=kept, mon=mon, barrier=barrier,
                    paired=paired,
                )  # fmt: skip
                barrier()
                if rank == 0:
                    remove(kept)
            if "steps" in phases:
                from . import steptime

                group = dist.new_group(backend="gloo") if world > 1 else None
                out["steps"] = _phase(
                    out, "steps", world, steptime.run,
                    lambda st: make_saver(args.method, st, ctx), state, root / "steps",
                    every=args.every, checkpoints=args.checkpoints, baseline=args.baseline, batch=args.batch,
                    width=args.mlp_width, seed=args.seed, group=group, barrier=barrier,
                )  # fmt: skip
        finally:
            mon.close()
            paired.close()
        return out
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _phase(out: dict[str, Any], name: str, world: int, fn: Callable[..., Any], *a: Any, **kw: Any) -> Any:
    """Run a later phase; on one process a failure is recorded and the worker goes on (on several
    ranks it is raised: the other ranks may be waiting in a collective)."""
    try:
        return fn(*a, **kw)
    except Exception as e:
        if world > 1:
            raise
        traceback.print_exc()
        out.setdefault("phase_errors", {})[name] = f"{type(e).__name__}: {e}"
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.suite.worker", description=__doc__)
    ap.add_argument("--method", required=True, choices=[*METHODS, "reference"])
    ap.add_argument("--layout", default="single", choices=("single", "ddp", "fsdp"))
    ap.add_argument("--size-gb", type=float, required=True)
    ap.add_argument("--regime", choices=("hot", "cold"), required=True)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--phases", default="saves,loads,steps")
    ap.add_argument("--floor", action="store_true", help="reference: also the copy floor")
    ap.add_argument("--cold-sleep", type=float, default=10.0)
    ap.add_argument("--load-regime", choices=("fresh-node", "same-node"), default="fresh-node")
    ap.add_argument("--idle", type=float, default=12.0)
    ap.add_argument("--every", type=int, default=40)
    ap.add_argument("--checkpoints", type=int, default=3)
    ap.add_argument("--baseline", type=int, default=40)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--mlp-width", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--op-timeout", type=float, default=600.0)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--result", required=True)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        res, code = worker(args), 0
    except BaseException as e:  # report every failure, then exit non-zero
        traceback.print_exc()
        res = {"method": args.method, "rank": os.environ.get("RANK", "0"), "error": f"{type(e).__name__}: {e}"}
        code = 1
    tmp = Path(args.result + ".tmp")
    tmp.write_text(json.dumps(res, default=str))
    tmp.replace(args.result)
    return code


if __name__ == "__main__":
    sys.exit(main())
