"""What a save's coordination and metadata cost as ranks grow (format version 2, issue 19).

    python -m benchmarks.bench_scale [--ranks 8 512 2048 16384] [--tensors 1000] [--layout fsdp|2d]

Drives the library's own messages and pure functions (no processes, no I/O) with synthetic
layouts: ``fsdp``, every rank one row block of each of ``--tensors`` tensors, plus one replicated
scalar per ten tensors (an optimizer's step counts); ``2d``, the same tensors on an 8-wide tensor-
parallel mesh (rows over R/8 data-parallel ranks, columns over 8). Per world size R:

- bytes one rank sends and receives in the collectives of a later save (hellos and outcomes go
  to rank 0 in one 1 KiB slot each; rank 0 answers each with one small broadcast), and what rank
  0 receives;
- rank 0's commit: time and peak memory (tracemalloc) to take R outcomes and write the manifest;
- the manifest's and one index's bytes;
- a loader's planning on the same world and on half of it: parse the manifest, find the
  indexes its regions need, parse them, assemble its view;
- the first save (and any save after a change of structure), from descriptions: the one
  description every rank receives (broadcast by one rank), the membership byte per rank in rank
  0's answer, and the time each rank takes to work out the catalog and its own part;
- the same by the general path (irregular layouts): each rank's layout sent to rank 0 only, and
  rank 0's writer assignment and catalog over R x T chunks (measured up to ``--first-up-to``
  ranks, projected linearly beyond).
"""

from __future__ import annotations

import argparse
import gc
import pickle
import time
import tracemalloc
from typing import Any

from stashpoint._core.assign import ChunkMeta, assign_writers
from stashpoint._core.catalog import catalog_of, placement
from stashpoint._core.described import Description, KeyDesc, Spread, described_catalog
from stashpoint._core.format import Chunk, FileEntry
from stashpoint._core.index import Head, RankIndex, assemble, parse_head, parse_index
from stashpoint._core.naming import shard_name
from stashpoint._core.reshard import Box
from stashpoint._dist.commit import LayoutMsg, Outcome, SaveHello, Start, Written, _Verdict
from stashpoint._dist.messages import GATHER_SLOT, SLOT_HEADER
from stashpoint._save.job import Totals

ROWS, COLS, TP = 8, 256, 8
SAVE_ID = "0123456789abcdef"
SLOT = GATHER_SLOT + SLOT_HEADER


def _boxes(rank: int, ranks: int, layout: str) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """(global shape, offsets, shape) of a rank's block of every big tensor."""
    if layout == "fsdp":
        return (ROWS * ranks, COLS), (ROWS * rank, 0), (ROWS, COLS)
    dp, tp = divmod(rank, TP)
    return (ROWS * ranks // TP, COLS * TP), (ROWS * dp, COLS * tp), (ROWS, COLS)


def _keys(tensors: int) -> list[str]:
    return [f"model.layers.{t // 8}.w{t % 8}" for t in range(tensors)]


def _scalars(tensors: int) -> list[str]:
    return [f"optim.state.{t}.step" for t in range(tensors // 10)]


def layout(rank: int, ranks: int, tensors: int, kind: str) -> LayoutMsg:
    gshape, off, shp = _boxes(rank, ranks, kind)
    chunks = [ChunkMeta(k, "float32", gshape, off, shp, 4) for k in _keys(tensors)]
    chunks += [ChunkMeta(k, "float32", (), (), (), 4) for k in _scalars(tensors)]
    return LayoutMsg(tuple(chunks), {}, {c.key: (c.dtype, c.global_shape) for c in chunks}, None)


def description(ranks: int, tensors: int, kind: str) -> Description:
    """What every rank describes: the same on all of them."""
    gshape, _, _ = _boxes(0, ranks, kind)
    spread = Spread((ranks,), 0, (1,), (0,)) if kind == "fsdp" else Spread((ranks // TP, TP), 0, (TP, 1), (0, 1))
    keys = [KeyDesc(k, "float32", gshape, 4, spread) for k in _keys(tensors)]
    keys += [KeyDesc(k, "float32", (), 4, None) for k in _scalars(tensors)]
    return Description(tuple(keys), ())


def _described_first(ranks: int, tensors: int, kind: str) -> tuple[int, float]:
    """A described first plan, as each rank makes it: (description bytes, seconds for the
    catalog and this rank's part; the best of 3)."""
    desc = description(ranks, tensors, kind)
    raw = pickle.dumps(desc, protocol=pickle.HIGHEST_PROTOCOL)
    rank = ranks // 2 + 1
    mine = layout(rank, ranks, tensors, kind).chunks
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        got = described_catalog([pickle.loads(raw)], bytes(ranks))
        assert got is not None
        given = [c for c in mine if got.writes(*c.ident, rank)]
        best = min(best, time.perf_counter() - t0)
    assert len(given) == tensors, "each rank writes its block of every sharded tensor"
    return len(raw), best


def catalog(ranks: int, tensors: int, kind: str) -> dict[str, Any]:
    """Rank 0's catalog, built as ``catalog_of`` builds it, one key at a time (R cells each)."""
    out: dict[str, Any] = {}
    for key in _keys(tensors):
        cells = []
        for r in range(ranks):
            gshape, off, shp = _boxes(r, ranks, kind)
            cells.append((off, shp, r))
        out[key] = placement(key, "float32", gshape, cells)
    for key in _scalars(tensors):
        out[key] = placement(key, "float32", (), [((), (), 0)])
    return out


def index_of(rank: int, ranks: int, tensors: int, kind: str) -> RankIndex:
    name = shard_name(rank, 0, SAVE_ID)
    nbytes = ROWS * COLS * 4
    _, off, shp = _boxes(rank, ranks, kind)
    chunks = {k: Chunk(name, off, shp, 4096 + i * nbytes, 4096 + (i + 1) * nbytes, ("0" * 16,)) for i, k in
              enumerate(_keys(tensors))}
    at = 4096 + tensors * nbytes
    if rank == 0:
        chunks |= {k: Chunk(name, (), (), at + 4 * i, at + 4 * i + 4, ("0" * 16,)) for i, k in
                   enumerate(_scalars(tensors))}
    size = at + 4 * len(_scalars(tensors))
    tree = {"dict": [[k, {"tensor": k}] for k in [*_keys(tensors), *_scalars(tensors)]] + [["step", {"value": 100}]]}
    return RankIndex(rank, SAVE_ID, (FileEntry(name, size, 4096, "0" * 16, rank),), chunks, tree)


def _commit(ranks: int, cat: dict[str, Any], outcome: bytes) -> tuple[bytes, float, int]:
    """Rank 0's commit from R gathered outcome slots: (manifest, seconds, peak bytes)."""
    took = min(_commit_once(ranks, cat, outcome) for _ in range(3))
    slots = [bytearray(SLOT) for _ in range(ranks)]  # what the gather fills on rank 0
    gc.collect()
    tracemalloc.start()
    for s in slots:
        s[8 : 8 + len(outcome)] = outcome
    outcomes = [pickle.loads(bytes(s[8 : 8 + len(outcome)])) for s in slots]
    written = [o.payload for o in outcomes]
    head = Head(SAVE_ID, "2026-12-03T00:00:00+00:00", "0", "0", ranks,
                tuple((w.index_size, w.index_checksum) for w in written), cat)
    raw = head.to_json()
    peak = tracemalloc.get_traced_memory()[1] + ranks * SLOT  # the slots were allocated before tracing
    tracemalloc.stop()
    return raw, took, peak


def _commit_once(ranks: int, cat: dict[str, Any], outcome: bytes) -> float:
    """The same commit, timed without tracing (the best of a few runs: the machine is shared)."""
    slots = [bytearray(SLOT) for _ in range(ranks)]
    t0 = time.perf_counter()
    for s in slots:
        s[8 : 8 + len(outcome)] = outcome
    written = [pickle.loads(bytes(s[8 : 8 + len(outcome)])).payload for s in slots]
    Head(SAVE_ID, "2026-12-03T00:00:00+00:00", "0", "0", ranks,
         tuple((w.index_size, w.index_checksum) for w in written), cat).to_json()
    return time.perf_counter() - t0


def _region(rank: int, ranks: int, saved: int, kind: str) -> Box:
    """The block of each big tensor that ``rank`` of ``ranks`` loads, of a ``saved``-rank checkpoint."""
    gshape, _, _ = _boxes(0, saved, kind)
    rows = -(-gshape[0] // (ranks if kind == "fsdp" else max(1, ranks // TP)))
    if kind == "fsdp":
        return Box((rows * rank, 0), (min(rows, gshape[0] - rows * rank), COLS))
    dp, tp = divmod(rank, TP)
    return Box((rows * dp, COLS * tp), (min(rows, gshape[0] - rows * dp), COLS))


def _plan_load(raw: bytes, ranks: int, saved: int, tensors: int, kind: str, *, rank: int) -> tuple[float, int]:
    """One loader of ``ranks`` planning its load of a ``saved``-rank checkpoint: (seconds, indexes read)."""
    blobs = {}
    t0 = time.perf_counter()
    head = parse_head(raw, "manifest")
    assert isinstance(head, Head)
    region = _region(rank, ranks, saved, kind)
    wanted = [(k, region) for k in _keys(tensors)] + [(k, Box((), ())) for k in _scalars(tensors)]
    need: set[int] = {rank % saved}
    for key, region in wanted:
        need.update(w for _, w in head.catalog[key].overlapping(region))
    build = time.perf_counter() - t0
    for r in need:  # index bytes come from storage; making them here is not the loader's work
        blobs[r] = index_of(r, saved, tensors, kind).to_json()
    t0 = time.perf_counter()
    view = assemble(head, {r: parse_index(blobs[r], f"index {r}", head, r) for r in sorted(need)}, rank % saved)
    assert len(view.tensors) == len(wanted)
    return build + time.perf_counter() - t0, len(need)


def measure(ranks: int, tensors: int, kind: str, first_up_to: int) -> dict[str, Any]:
    loc = "/checkpoints/run/step-00001000"
    hello = pickle.dumps(SaveHello("0" * 32, SAVE_ID, 1, loc, None, True, "0" * 32), protocol=pickle.HIGHEST_PROTOCOL)
    idx = index_of(0, ranks, tensors, kind).to_json()
    outcome = pickle.dumps(Outcome(payload=Written(len(idx), "0" * 16, 1), nbytes=10**9),
                           protocol=pickle.HIGHEST_PROTOCOL)
    assert len(hello) <= GATHER_SLOT and len(outcome) <= GATHER_SLOT
    answers = [Start(SAVE_ID, True), _Verdict(summary=Totals(10**12, ranks, tensors))]
    received = sum(8 + len(pickle.dumps(a)) + 8 for a in answers)  # each broadcast: its length, then it
    t0 = time.perf_counter()
    cat = catalog(ranks, tensors, kind)
    catalog_s = time.perf_counter() - t0
    raw, commit_s, commit_peak = _commit(ranks, cat, outcome)
    same = _plan_load(raw, ranks, ranks, tensors, kind, rank=ranks // 2 + 1)
    half = _plan_load(raw, ranks // 2, ranks, tensors, kind, rank=ranks // 4 + 1) if ranks >= 16 else (0.0, 0)
    row: dict[str, Any] = {
        "ranks": ranks,
        "later_send": 2 * SLOT,
        "later_recv": received,
        "rank0_recv": 2 * SLOT * ranks,
        "commit_s": commit_s,
        "commit_peak": commit_peak,
        "manifest": len(raw),
        "index": len(idx),
        "plan_same": same,
        "plan_half": half,
        "catalog_s": catalog_s,
        "layout_msg": len(pickle.dumps(layout(1, ranks, tensors, kind), protocol=pickle.HIGHEST_PROTOCOL)),
    }
    row["desc_bytes"], row["desc_s"] = _described_first(ranks, tensors, kind)
    row["start_bytes"] = len(pickle.dumps(Start(SAVE_ID, False, described=((0,), bytes(ranks)))))
    if ranks <= first_up_to:
        layouts = [layout(r, ranks, tensors, kind) for r in range(ranks)]
        t0 = time.perf_counter()
        writers = assign_writers([m.chunks for m in layouts])
        catalog_of((kv for m in layouts for kv in m.keyinfo.items()), (), writers)
        row["first_s"] = time.perf_counter() - t0
    return row


def _gloo_rank(root: str, tensors: int) -> None:
    """One rank of a real gloo run: save a DTensor state sharded over every rank 4 times; print
    the bytes this rank sent and received on stashpoint's group in each save, and its time."""
    import json
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import stashpoint
    from stashpoint._dist import group as _group

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    state: dict[str, Any] = {k: DTensor.from_local(torch.randn(ROWS, COLS), mesh, [Shard(0)], run_check=False)
                             for k in _keys(tensors)}
    state |= {k: torch.tensor(1.0) for k in _scalars(tensors)}
    saves = []
    for i in range(4):
        ctx = next(iter(_group._contexts().values()), None)
        before = (ctx.sent, ctx.received) if ctx is not None else (0, 0)
        t0 = time.perf_counter()
        stashpoint.save(state, f"{root}/s{i}", timeout=300)
        took = time.perf_counter() - t0
        ctx = next(iter(_group._contexts().values()))
        saves.append((ctx.sent - before[0], ctx.received - before[1], took))
    print("GLOO " + json.dumps({"rank": dist.get_rank(), "saves": saves}), flush=True)
    os._exit(0)  # torch 2.13's gloo teardown after DTensor use may abort; the result is out


def gloo(ranks: int, tensors: int) -> list[dict[str, Any]]:
    """Run :func:`_gloo_rank` on ``ranks`` real processes (this machine, gloo over loopback)."""
    import json
    import os
    import socket
    import subprocess
    import sys
    import tempfile

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as root:
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "benchmarks.bench_scale", "--rank-of", root, "--tensors", str(tensors)],
                env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"},
                stdout=subprocess.PIPE, text=True,
            )
            for r in range(ranks)
        ]
        outs = [p.communicate(timeout=1200)[0] for p in procs]
    return sorted((json.loads(ln[5:]) for o in outs for ln in o.splitlines() if ln.startswith("GLOO ")),
                  key=lambda d: d["rank"])


def _b(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 512, 2048, 16384])
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--layout", choices=["fsdp", "2d"], default="fsdp")
    ap.add_argument("--first-up-to", type=int, default=512)
    ap.add_argument("--gloo", type=int, nargs="*", default=[], help="also run real gloo saves on these world sizes")
    ap.add_argument("--rank-of", help=argparse.SUPPRESS)  # internal: be one rank of a --gloo run
    args = ap.parse_args()
    if args.rank_of:
        _gloo_rank(args.rank_of, args.tensors)
        return
    t = args.tensors
    if args.gloo:
        _print_gloo(args.gloo, t)
        return
    print(f"layout {args.layout}: T = {t} tensors per rank ({ROWS}x{COLS} float32 blocks) + {t // 10} replicated "
          "scalars")
    print("| R | later save: per rank sent / received | rank 0 receives | rank 0 commit: time / peak memory | "
          "manifest | one index | load planning, same world (indexes) | load planning, R -> R/2 (indexes) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = [measure(r, t, args.layout, args.first_up_to) for r in args.ranks]
    for r in rows:
        (s1, n1), (s2, n2) = r["plan_same"], r["plan_half"]
        print(
            f"| {r['ranks']:,} | {_b(r['later_send'])} / {_b(r['later_recv'])} | {_b(r['rank0_recv'])} "
            f"| {r['commit_s']:.3f} s / {_b(r['commit_peak'])} | {_b(r['manifest'])} | {_b(r['index'])} "
            f"| {s1 * 1000:.0f} ms ({n1}) | " + (f"{s2 * 1000:.0f} ms ({n2}) |" if n2 else "- |")
        )
    print()
    print("First save (or a changed structure) from descriptions: one rank broadcasts the description; every rank "
          "works out the catalog and its own part")
    print("| R | hello per rank (to rank 0) | received per rank: description + rank 0's answer | rank 0 receives "
          "| each rank: catalog + own part |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['ranks']:,} | {_b(SLOT)} | {_b(r['desc_bytes'])} + {_b(r['start_bytes'])} "
              f"| {_b(SLOT * r['ranks'])} | {r['desc_s'] * 1000:.0f} ms |")
    print()
    print("First save by the general path (irregular layouts): each rank sends its layout to rank 0 only; rank 0 "
          "assigns writers and builds the catalog")
    print("| R | layout sent per rank | rank 0 receives | rank 0: assign + catalog |")
    print("|---:|---:|---:|---:|")
    measured = [r for r in rows if "first_s" in r]
    per_chunk = measured[-1]["first_s"] / measured[-1]["ranks"] if measured else 0.0
    for r in rows:
        first = f"{r['first_s']:.2f} s" if "first_s" in r else f"{per_chunk * r['ranks']:.0f} s (projected)"
        print(f"| {r['ranks']:,} | {_b(r['layout_msg'])} | {_b(r['layout_msg'] * r['ranks'])} | {first} |")


def _print_gloo(worlds: list[int], tensors: int) -> None:
    print(f"real gloo saves, T = {tensors} DTensor blocks + {tensors // 10} replicated scalars per rank; later saves")
    print("| R | model: per rank sent / received | measured: other ranks' max sent / received | rank 0 sent / "
          "received | first save: rank 0 / other ranks' max received | later save time (median) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for ranks in worlds:
        res = gloo(ranks, tensors)
        assert len(res) == ranks, f"{len(res)} of {ranks} ranks reported"
        later = [s for r in res for s in r["saves"][1:]]
        others = [s for r in res[1:] for s in r["saves"][1:]]
        root = res[0]["saves"][1:]
        times = sorted(s[2] for s in later)
        print(f"| {ranks} | {_b(2 * SLOT)} / ~{_b(350)} | {_b(max(s[0] for s in others))} / "
              f"{_b(max(s[1] for s in others))} | {_b(max(s[0] for s in root))} / {_b(max(s[1] for s in root))} "
              f"| {_b(res[0]['saves'][0][1])} / {_b(max(r['saves'][0][1] for r in res[1:]))} "
              f"| {times[len(times) // 2] * 1000:.0f} ms |")


if __name__ == "__main__":
    main()
