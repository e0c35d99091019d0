"""What a save's coordination and metadata cost as ranks grow: the baseline issue 19 must beat.

    python -m benchmarks.bench_scale [--ranks 8 64 256 512] [--tensors 1000] [--project 16384]

Drives the library's own messages and pure functions (no processes, no I/O) with a synthetic
FSDP2 layout: every rank holds one row-block of each of ``--tensors`` tensors. Per world size R:

- bytes one rank sends, and receives, in each collective of a first save ("layout hashes",
  "layouts", "outcomes") and of a later save (the layouts are not exchanged again);
- the writer assignment over R x T chunks, which every rank computes;
- rank 0's manifest: its bytes and the time to build and encode it; a loader's time to parse it.

Collective sizes are the pickled messages (``all_gather_object`` pickles each); every rank
receives all R of them. The last row projects the largest measured R linearly to ``--project``
(a version-1 manifest of 1,000 tensors on 1,024 ranks is over the entry cap: it cannot be read).
"""

from __future__ import annotations

import argparse
import pickle
import time
from typing import Any

from stashpoint._core.assign import ChunkMeta, assign_writers, merge_trees
from stashpoint._core.format import Chunk, FileEntry, Manifest, TensorEntry, parse_manifest
from stashpoint._core.naming import shard_name
from stashpoint._dist.commit import LayoutMsg, Outcome, SaveHello, Written

ROWS, COLS = 8, 256  # each rank's block of each tensor: 8 rows of 256 float32 (8 KiB)


def _layout(rank: int, ranks: int, tensors: int) -> LayoutMsg:
    chunks = tuple(
        ChunkMeta(f"model.layers.{t // 8}.w{t % 8}", "float32", (ROWS * ranks, COLS), (ROWS * rank, 0), (ROWS, COLS), 4)
        for t in range(tensors)
    )
    keyinfo = {c.key: (c.dtype, c.global_shape) for c in chunks}
    return LayoutMsg(chunks, {}, keyinfo, None)


def _written(rank: int, layout: LayoutMsg) -> Written:
    name = shard_name(rank, 0, "0123456789abcdef")
    nbytes = ROWS * COLS * 4
    chunks = {
        c.key: (name, 4096 + i * nbytes, 4096 + (i + 1) * nbytes, ("0" * 16,)) for i, c in enumerate(layout.chunks)
    }
    tree = {"dict": [[c.key, {"tensor": c.key}] for c in layout.chunks] + [["step", {"value": 100}]]}
    size = 4096 + len(chunks) * nbytes
    return Written((FileEntry(name, size, 4096, "0" * 16, rank),), chunks, tree, size)


def _manifest(layouts: list[LayoutMsg], written: list[Written]) -> Manifest:
    chunks: dict[str, list[Chunk]] = {}
    keyinfo: dict[str, tuple[str, tuple[int, ...]]] = {}
    for layout, w in zip(layouts, written):
        keyinfo.update(layout.keyinfo)
        where = {c.key: c for c in layout.chunks}
        for key, (fname, start, end, sums) in w.chunks.items():
            c = where[key]
            chunks.setdefault(key, []).append(Chunk(fname, c.offsets, c.shape, start, end, sums))
    tensors = {
        k: TensorEntry(k, d, s, tuple(sorted(chunks[k], key=lambda c: c.offsets))) for k, (d, s) in keyinfo.items()
    }
    trees, of_rank = merge_trees([w.tree for w in written])
    files = tuple(f for w in written for f in w.files)
    return Manifest("0" * 16, "2026-01-01T00:00:00+00:00", "0", "0", files, tensors, trees, {}, len(written), of_rank)


def measure(ranks: int, tensors: int) -> dict[str, Any]:
    layouts = [_layout(r, ranks, tensors) for r in range(ranks)]
    written = [_written(r, layouts[r]) for r in range(ranks)]
    hello = len(pickle.dumps(SaveHello("0" * 32, "0" * 16, 1, "/checkpoints/run/step-00001000", None, True)))
    layout_b = len(pickle.dumps(layouts[0]))
    outcome_b = len(pickle.dumps(Outcome(payload=written[0], nbytes=written[0].nbytes)))
    t0 = time.perf_counter()
    assign_writers([m.chunks for m in layouts])
    assign_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    raw = _manifest(layouts, written).to_json()
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    parse_manifest(raw, "bench")
    parse_s = time.perf_counter() - t0
    return {
        "ranks": ranks,
        "first_send": hello + layout_b + outcome_b,
        "first_recv": ranks * (hello + layout_b + outcome_b),
        "later_send": hello + outcome_b,
        "later_recv": ranks * (hello + outcome_b),
        "assign_s": assign_s,
        "manifest_bytes": len(raw),
        "build_s": build_s,
        "parse_s": parse_s,
    }


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256, 512])
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--project", type=int, default=16384)
    args = ap.parse_args()
    print(f"T = {args.tensors} tensors per rank, one {ROWS}x{COLS} float32 block of each (FSDP2-like)")
    print("| R | first save: sent / received per rank | later save: sent / received per rank | "
          "writer assignment (every rank) | manifest | build + encode (rank 0) | parse (each loader) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    rows = [measure(r, args.tensors) for r in args.ranks]
    last = rows[-1]
    k = args.project / last["ranks"]
    proj = {**last, "ranks": args.project}
    for key in ("first_recv", "later_recv", "assign_s", "manifest_bytes", "build_s", "parse_s"):
        proj[key] = last[key] * k
    for row, tag in [*((r, "") for r in rows), (proj, " (projected)")]:
        print(
            f"| {row['ranks']:,}{tag} | {_fmt_bytes(row['first_send'])} / {_fmt_bytes(row['first_recv'])} "
            f"| {_fmt_bytes(row['later_send'])} / {_fmt_bytes(row['later_recv'])} | {row['assign_s']:.2f} s "
            f"| {_fmt_bytes(row['manifest_bytes'])} | {row['build_s']:.2f} s | {row['parse_s']:.2f} s |"
        )


if __name__ == "__main__":
    main()
