"""What reading a manifest costs, up to the caps: time and peak memory of ``parse_manifest`` (every
structural rule checked) for manifests of growing entry counts, each parsed in a fresh process.

    python -m benchmarks.bench_manifest_parse [--entries 100000 500000 2000000]

The manifests are FSDP-like: each tensor is split row-wise over ``--ranks`` shard files, one chunk
per rank, so entries = tensors x ranks. Prints per size: manifest bytes, parse time, the process's
peak RSS growth while parsing, and both per entry. The default's last manifest is at the entry cap.
The hostile rows are manifests of the items that cost JSON the most memory per byte, as large as
the caps admit: their peaks are what any manifest can make a reader allocate.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from stashpoint._core.format import Chunk, FileEntry, Manifest, TensorEntry
from stashpoint._core.sealed import MAX_MANIFEST_BYTES, MAX_MANIFEST_ENTRIES, MAX_PARSE_MEMORY, _parse_memory_bound


def build(entries: int, ranks: int) -> bytes:
    """A valid manifest of ``entries`` chunks: ``entries // ranks`` tensors of ``ranks`` rows of 16 floats."""
    names = [f"shard-r{r:05d}-0123456789abcdef.safetensors" for r in range(ranks)]
    files = tuple(FileEntry(name, 1 << 40, 64, "0" * 16, r) for r, name in enumerate(names))
    tensors = {}
    for t in range(entries // ranks):
        key = f"model.layers.{t // 8}.mlp.w{t % 8}.weight"
        at = 64 + 64 * t
        chunks = tuple(Chunk(names[r], (r, 0), (1, 16), at, at + 64, ("0" * 16,)) for r in range(ranks))
        tensors[key] = TensorEntry(key, "float32", (ranks, 16), chunks)
    tree = {"dict": [[k, {"tensor": k}] for k in tensors]}
    m = Manifest("0" * 32, "2026-01-01T00:00:00Z", "0", "0", files, tensors, (tree,), world_size=ranks)
    m = Manifest(**{**m.__dict__, "tree_of_rank": (0,) * ranks})
    return m.to_json()


# Item shapes that make JSON cost the most memory per byte; "%d" makes each item distinct.
HOSTILE = {
    "empty objects": b"{}",
    "one-key objects": b'{"k%d":0}',
    "empty lists": b"[]",
    "short strings": b'"%d"',
    "floats": b"0.5",
}


def hostile(item: bytes) -> bytes:
    """A manifest of ``item`` repeated in a list, as many as the parse's memory bound admits
    (refused later, but only after the JSON is parsed, which is where the memory goes)."""
    head, tail = b'{"format":"stashpoint","trees":[{"list":[', b"0]}]}"
    one = _parse_memory_bound(item % 1000000 + b",") if b"%d" in item else _parse_memory_bound(item + b",")
    n = min((MAX_PARSE_MEMORY - 4096) // one, (MAX_MANIFEST_BYTES - 4096) // (len(item) + 8))
    items = (item % i if b"%d" in item else item for i in range(n))
    return head + b",".join(items) + b"," + tail


def _child(path: str) -> None:
    from stashpoint._core.format import parse_manifest
    from stashpoint.errors import CheckpointError

    with open(path, "rb") as f:
        raw = f.read()
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak (VmHWM) to the current RSS, so the import's peak is not counted
    t0 = time.perf_counter()
    try:
        parse_manifest(raw, path)
        refused = ""
    except CheckpointError as e:
        refused = str(e)[-100:]
    dt = time.perf_counter() - t0
    grew = _status_kib("VmHWM") - before
    print(json.dumps({"seconds": dt, "peak_growth_bytes": grew * 1024, "refused": refused}))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        return _child(sys.argv[2])
    ap = argparse.ArgumentParser()
    ap.add_argument("--entries", type=int, nargs="+", default=[100_000, 500_000, MAX_MANIFEST_ENTRIES])
    ap.add_argument("--ranks", type=int, default=1000)
    ap.add_argument("--hostile", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    caps = f"{MAX_MANIFEST_ENTRIES:,} entries, {MAX_MANIFEST_BYTES >> 20} MiB, {MAX_PARSE_MEMORY >> 30} GiB bound"
    print(f"caps: {caps}")
    print("| entries | manifest | parse | peak RSS growth | per entry |")
    print("|---:|---:|---:|---:|---:|")
    runs: list[tuple[str, int, Callable[[], bytes]]] = [
        (f"{n:,}", n, functools.partial(build, n, args.ranks)) for n in args.entries
    ]
    if args.hostile:
        runs += [(f"hostile: {name}", 0, functools.partial(hostile, item)) for name, item in HOSTILE.items()]
    for label, n, make in runs:
        raw = make()
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            f.write(raw)
        try:
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.bench_manifest_parse", "--child", f.name],
                capture_output=True, text=True, check=False, env={**os.environ, "PYTHONHASHSEED": "0"},
            )  # fmt: skip
        finally:
            Path(f.name).unlink()
        if out.returncode != 0:
            print(f"| {label} | {len(raw) / 2**20:.1f} MiB | failed: {out.stderr.strip().splitlines()[-1]} | | |")
            continue
        r = json.loads(out.stdout)
        per = f"{r['seconds'] / n * 1e6:.1f} µs, {r['peak_growth_bytes'] / n:,.0f} B" if n else "refused"
        print(
            f"| {label} | {len(raw) / 2**20:.1f} MiB | {r['seconds']:.1f} s "
            f"| {r['peak_growth_bytes'] / 2**20:,.0f} MiB | {per} |"
        )


if __name__ == "__main__":
    main()
