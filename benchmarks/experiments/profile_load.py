"""Profile ``stashpoint.load`` of the suite's state on several ranks (where a load's time goes).

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m benchmarks.experiments.profile_load \
        --size-gb 0.5 --layout fsdp

Saves the suite's GPT-style state (``benchmarks/suite/state.py``) once, then loads it three
times into the scrambled live state, the checkpoint's pages evicted before each load (a fresh
node), or with ``--same-node`` 12 s after the save and nothing evicted (a process restarted on
the node: the save's read-back has cached the files); prints each rank's load times and rank
0's cProfile of the last load (cumulative and own time).
A profile, not a benchmark: the side-by-side figures come from ``python -m benchmarks``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

import stashpoint
from benchmarks.suite.common import evict_cache
from benchmarks.suite.state import build, choose_shape, scramble


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=float, default=0.5, help="state size in GB (default 0.5)")
    ap.add_argument("--layout", choices=("fsdp", "ddp"), default="fsdp", help="how the ranks hold the state")
    ap.add_argument("--dir", default="/var/tmp", help="scratch base (default /var/tmp)")
    ap.add_argument("--top", type=int, default=30, help="profile rows to print (default 30)")
    ap.add_argument("--same-node", action="store_true", help="load from the page cache, 12 s after the save")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state = build(args.layout, choose_shape(args.size_gb), 0, rank, world)
    base = [tempfile.mkdtemp(prefix="stashpoint-profile-load-", dir=args.dir) if rank == 0 else ""]
    dist.broadcast_object_list(base)
    path = Path(base[0]) / "ckpt"
    stashpoint.save(state, path)
    if args.same_node:
        time.sleep(12)
    for i in range(3):
        scramble(state)
        dist.barrier()
        if rank == 0 and not args.same_node:
            evict_cache(path)
        dist.barrier()
        prof = cProfile.Profile() if i == 2 else None
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        stashpoint.load(state, path)
        if prof is not None:
            prof.disable()
        print(f"rank {rank}: load {i + 1}/3 took {time.perf_counter() - t0:.3f} s", flush=True)
        if prof is not None and rank == 0:
            for order in ("cumulative", "tottime"):
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats(order).print_stats(args.top)
                print(out.getvalue(), flush=True)
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(base[0], ignore_errors=True)
    dist.barrier()
    os._exit(0)  # gloo's teardown at interpreter exit can abort (a torch issue; see the tests' workers)


if __name__ == "__main__":
    main()
