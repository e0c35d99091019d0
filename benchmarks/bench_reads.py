"""Loads: direct-I/O reads against buffered reads, on checkpoints never read before.

    python -m benchmarks.bench_reads --size-gb 2 --repeats 3 [--regime fresh-node|same-node]

What a resume after a crash does: read a checkpoint that was written (by stashpoint: with direct
I/O) and never read since. Each trial saves a fresh checkpoint of the suite's GPT + AdamW state,
evicts its pages, and loads it once into the live state, with ``LocalStorage(direct_io=True)``
(the default: O_DIRECT reads through bounce buffers) and ``direct_io=False`` (buffered reads,
as before); a ``dcp.load`` of a fresh DCP checkpoint of the same state runs in the same trials
for reference. A second load of the same files ("again") shows what a cache outside this
machine's page cache (a virtual disk's host) adds. Trials alternate the methods.

``--regime same-node`` is the restart after a process crash on the same machine instead: the
pages stay as the save left them (buffered writes cached, direct-I/O writes not), and the load
comes ``--idle`` seconds later (stashpoint's committed shards are read back into the page
cache in that time: ``LocalStorage(cache_newest=True)``, the default). Both regimes also time
a raw read of a stashpoint checkpoint's files (each read whole, buffered, into one reused
64 MiB buffer: the bytes the tier gives, with no memory of its own to fault in), the same read
into memory the size of the files (allocated and touched before: each byte lands somewhere of
its own, as a load's must), and ``torch.load(mmap=True)`` plus a copy into the state.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.suite.common import GB, default_scratch_base, evict_cache, git_commit
from benchmarks.suite.savers import dcp_loader, fqn_state_dict, set_fqn_state_dict
from benchmarks.suite.state import build, choose_shape, local_bytes

METHODS = ("direct", "buffered", "dcp", "torch", "raw", "raw_state")


def log(msg: str) -> None:
    print(f"[bench_reads {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_reads", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="scratch base (default /var/tmp; removed afterwards)")
    ap.add_argument("--regime", choices=("fresh-node", "same-node"), default="fresh-node")
    ap.add_argument("--idle", type=float, default=12.0, help="seconds between save and load (same-node)")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed.checkpoint as dcp

    import stashpoint
    from stashpoint._storage import LocalStorage

    torch.set_num_threads(2)
    state = build("single", choose_shape(args.size_gb), 0)
    nbytes = local_bytes(state)[0]
    root = Path(tempfile.mkdtemp(prefix="bench-reads-", dir=args.dir or default_scratch_base()))
    load_dcp = dcp_loader(state)
    raw_buf = memoryview(bytearray(64 << 20))  # the raw read's, touched once
    state_buf = memoryview(bytearray(0))  # the raw read into memory of its own: grown, touched, reused
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in METHODS}
    try:
        for trial in range(args.repeats):
            for method in METHODS:
                if method == METHODS[0] and trial:
                    # torch.load(mmap=True) + set_state_dict leaves the optimizer holding the
                    # file's mapped pages (load_state_dict keeps tensors of the right dtype):
                    # every trial starts from state memory of its own
                    state = build("single", choose_shape(args.size_gb), 0)
                    load_dcp = dcp_loader(state)
                path = root / f"{method}-{trial}"
                if method == "dcp":
                    dcp.save(fqn_state_dict(state), checkpoint_id=str(path))
                elif method == "torch":
                    path.mkdir()
                    torch.save(fqn_state_dict(state), path / "state.pt")
                else:  # a fresh node never had the pages: nothing read back into this one's cache
                    stashpoint.save(state, LocalStorage(path, cache_newest=args.regime == "same-node"))
                if args.regime == "same-node":
                    time.sleep(args.idle)
                files = sorted(p for p in path.rglob("*") if p.is_file())
                if method == "raw_state" and len(state_buf) < sum(f.stat().st_size for f in files):
                    state_buf = memoryview(bytearray(sum(f.stat().st_size for f in files)))
                got = []
                for _ in range(2 if args.regime == "fresh-node" else 1):
                    if args.regime == "fresh-node":
                        os.sync()
                        evict_cache(path)
                    t0 = time.perf_counter()
                    if method == "dcp":
                        load_dcp(path)
                    elif method == "torch":
                        loaded = torch.load(path / "state.pt", mmap=True, weights_only=True)
                        set_fqn_state_dict(state, loaded)
                    elif method == "raw":
                        for f in files:
                            with f.open("rb", buffering=0) as fh:
                                while fh.readinto(raw_buf):
                                    pass
                    elif method == "raw_state":
                        pos = 0
                        for f in files:
                            with f.open("rb", buffering=0) as fh:
                                while n := fh.readinto(state_buf[pos:]):
                                    pos += n
                    else:
                        stashpoint.load(state, LocalStorage(path, direct_io=method == "direct"))
                    got.append(time.perf_counter() - t0)
                times[method].append((got[0], got[-1]))
                log(f"trial {trial + 1}: {method}: first {got[0]:.2f} s, again {got[-1]:.2f} s")
                shutil.rmtree(path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    how = "its pages evicted first" if args.regime == "fresh-node" else f"loaded {args.idle:g} s after its save"
    print(f"{nbytes / GB:.2f} GB state; stashpoint {stashpoint.__version__} ({git_commit()}); "
          f"median of {args.repeats} trials, each on a fresh checkpoint, {how}:\n")  # fmt: skip
    again_col = args.regime == "fresh-node"  # a same-node trial loads once
    print("| load | first read | GB/s |" + (" read again | GB/s |" if again_col else ""))
    print("|---|---:|---:|" + ("---:|---:|" if again_col else ""))
    labels = {
        "direct": "stashpoint.load, direct I/O (default)",
        "buffered": "stashpoint.load, buffered (direct_io=False)",
        "dcp": "dcp.load + set_state_dict",
        "torch": "torch.load(mmap=True) + copy into the state",
        "raw": "raw read of a stashpoint checkpoint's files (buffered)",
        "raw_state": "the same raw read into memory the size of the files",
    }
    for method in METHODS:
        first = statistics.median(t for t, _ in times[method])
        again = statistics.median(t for _, t in times[method])
        row = f"| {labels[method]} | {first:.2f} s | {nbytes / first / GB:.2f} |"
        print(row + (f" {again:.2f} s | {nbytes / again / GB:.2f} |" if again_col else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
