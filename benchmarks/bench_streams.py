"""Parallel writes: does this disk write faster with several direct-I/O streams than with one?

    python -m benchmarks.bench_streams --size-gb 2 --repeats 4

Two measurements, alternated trial by trial so that both see the same disk:

* raw: ``--size-gb`` written with ``O_DIRECT`` in 64 MiB writes from one reused buffer, split
  over 1, 2 and 4 files written at once (one thread each), each file fsynced;
* stashpoint: ``stashpoint.save`` of the suite's GPT + AdamW state of the same size with
  ``LocalStorage(path, write_streams=k)`` for k = 1, 2, 4, and shard files of ``--shard-mib``
  (default 256 MiB, so that every k has files to write at once), until committed and durable.

Prints the median GB/s of each. ``LocalStorage``'s default ``write_streams`` follows from it.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.suite.common import GB, default_scratch_base, git_commit
from benchmarks.suite.disk import _buffer, _write
from benchmarks.suite.state import build, choose_shape, local_bytes

STREAMS = (1, 2, 4)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_streams", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--shard-mib", type=int, default=256, help="max_shard_bytes of the saves, in MiB (default 256)")
    ap.add_argument("--dir", type=Path, default=None, help="scratch base (default /var/tmp; removed afterwards)")
    args = ap.parse_args(argv)

    import torch

    import stashpoint
    from stashpoint._storage import LocalStorage

    torch.set_num_threads(2)
    state = build("single", choose_shape(args.size_gb), 0)
    nbytes = local_bytes(state)[0]
    root = Path(tempfile.mkdtemp(prefix="bench-streams-", dir=args.dir or default_scratch_base()))
    buf = _buffer()
    raw: dict[int, list[float]] = {k: [] for k in STREAMS}
    saved: dict[int, list[float]] = {k: [] for k in STREAMS}
    stashpoint.save(state, root / "warm-up")  # staging buffers allocated once, not in the figures
    shutil.rmtree(root / "warm-up")
    try:
        for trial in range(args.repeats):
            for k in STREAMS:
                share = -(-nbytes // k // 4096) * 4096
                t0 = time.perf_counter()
                with cf.ThreadPoolExecutor(k) as pool:
                    list(pool.map(lambda i, n=share: _write(root / f"raw-{i}.bin", n, buf, True), range(k)))
                raw[k].append(time.perf_counter() - t0)
                for i in range(k):
                    (root / f"raw-{i}.bin").unlink()
                path = root / f"ck-{k}"
                t0 = time.perf_counter()
                stashpoint.save(state, LocalStorage(path, write_streams=k), max_shard_bytes=args.shard_mib << 20)
                saved[k].append(time.perf_counter() - t0)
                shutil.rmtree(path)
                got = f"raw {nbytes / raw[k][-1] / GB:.2f} GB/s, stashpoint.save {nbytes / saved[k][-1] / GB:.2f} GB/s"
                print(f"[bench_streams] trial {trial + 1}, {k} stream(s): {got}", file=sys.stderr, flush=True)
    finally:
        buf.close()
        shutil.rmtree(root, ignore_errors=True)
    print(f"{nbytes / GB:.2f} GB, {args.shard_mib} MiB shards; stashpoint {stashpoint.__version__} ({git_commit()}); "
          f"median of {args.repeats} trials:\n")  # fmt: skip
    print("| streams | raw direct-I/O write GB/s | stashpoint.save GB/s (until durable) |")
    print("|---:|---:|---:|")
    for k in STREAMS:
        r, w = nbytes / statistics.median(raw[k]) / GB, nbytes / statistics.median(saved[k]) / GB
        print(f"| {k} | {r:.2f} | {w:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
