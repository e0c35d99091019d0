"""Moving a step's files between two nodes' leaders: stashpoint's transfer against gloo alone.

    python -m benchmarks.bench_transfer [--mib 256] [--repeats 4] [--src /var/tmp] [--dst /dev/shm] [--cold]

Two ranks on this host (one gloo group, as node leaders use stashpoint's own). Rank 0 holds
four files of ``--mib`` / 4 each under ``--src``; each trial moves them to rank 1, which lands
them under ``--dst`` (``_dist.landing.land``: direct I/O where the file system allows it,
no fsync, as a restore fetches). ``--cold``: rank 0's files are dropped from the page cache
before each trial (a replica on a disk tier is not cached: it was written with direct I/O).
The reference is the same bytes through gloo alone, from and into buffers reused across
trials: no file read, no landing. Run it alone: two cores serve both ranks.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.suite.common import evict_cache
    from stashpoint._core.nodeplan import Transfer
    from stashpoint._dist import group
    from stashpoint._dist.landing import land
    from stashpoint._dist.stream import Stream
    from stashpoint._storage import LocalStorage

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    ctx = group.context(None, 120)
    assert ctx is not None
    size = args.mib // 4 << 20
    files = [(f"part{i}.bin", size) for i in range(4)]
    src, dst = Path(args.src_dir), Path(args.dst_dir)
    if rank == 0:
        src.mkdir(parents=True, exist_ok=True)
        block = os.urandom(1 << 20)
        for name, n in files:
            (src / name).write_bytes(block * (n >> 20))
    bufs = [torch.ones(16 << 20, dtype=torch.uint8) for _ in range(2)]
    got: dict[str, list[float]] = {"stashpoint": [], "gloo": []}
    for _ in range(args.repeats):
        if rank == 1:
            shutil.rmtree(dst, ignore_errors=True)
        if rank == 0 and args.cold:
            evict_cache(src)
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            stream = Stream(ctx, 1)
            for name, n in files:
                stream.send(LocalStorage(src), name, [(0, n)])
            stream.done_sending()
        else:
            land(LocalStorage(dst), Transfer(0, 1), files, Stream(ctx, 0), False)
        dist.barrier()
        got["stashpoint"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(args.mib // 16):
            (dist.send if rank == 0 else dist.recv)(bufs[i % 2], 1 - rank)
        dist.barrier()
        got["gloo"].append(time.perf_counter() - t0)
    if rank == 0:
        for what, times in got.items():
            med = statistics.median(times)
            trials = ", ".join(f"{t:.3f}" for t in times)
            print(f"{what}: {med:.3f} s ({args.mib / 1024 / med:.2f} GiB/s), trials {trials}", flush=True)
        shutil.rmtree(src, ignore_errors=True)
    else:
        shutil.rmtree(dst, ignore_errors=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="bytes moved per trial, in MiB (a multiple of 64)")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--src", default="/var/tmp", help="where rank 0's files are (default /var/tmp)")
    ap.add_argument("--dst", default="/var/tmp", help="where rank 1 lands them (/dev/shm: a memory tier)")
    ap.add_argument("--cold", action="store_true", help="rank 0's files dropped from the page cache each trial")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--src-dir", help=argparse.SUPPRESS)
    ap.add_argument("--dst-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.mib % 64:
        ap.error("--mib must be a multiple of 64")
    if args.worker:
        worker(args)
        return 0
    tag = f"bench-transfer-{os.getpid()}"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(Path(__file__).resolve()), "--worker", "--mib", str(args.mib), "--repeats", str(args.repeats),
        "--src-dir", str(Path(args.src) / f"{tag}-src"), "--dst-dir", str(Path(args.dst) / f"{tag}-dst"),
        *(["--cold"] if args.cold else []),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    print(f"{args.mib} MiB in 4 files, {args.src} ({'cold' if args.cold else 'cached'}) -> {args.dst}; "
          f"medians of {args.repeats}", flush=True)  # fmt: skip
    return subprocess.run(cmd, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
