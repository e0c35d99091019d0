"""Distributed benchmark: DCP against stashpoint on 2 real ranks (gloo) of this machine.

Two states, each in its own pair of processes:

* ``ddp``: the GPT-style model + AdamW state of ``bench_core`` replicated on both ranks (same
  seed), the case where writing replicated tensors once matters;
* ``fsdp``: the same model sharded with FSDP2 ``fully_shard`` on a CPU mesh, AdamW stepped once
  (parameters and moments are DTensors).

Per state: ``dcp.save``, DCP ``async_save`` (thread), ``stashpoint.save`` and
``stashpoint.async_save`` — one warm-up, then ``--repeats`` saves (hot page cache, each
checkpoint deleted before the next), every save started after a barrier; a figure is the max
over ranks, then the median over repeats. Bytes written per rank come from the files (DCP's
``__<rank>_<n>.distcp``; stashpoint's manifest, which records each shard's writer). Loads into
the live state (``dcp.load`` + ``set_state_dict``; ``stashpoint.load`` with ``exchange=True`` and
``False``) with the checkpoint's pages evicted (``posix_fadvise``) first, each verified.

    python -m benchmarks.bench_dist --size-gb 1.0 --repeats 2 \\
        --out benchmarks/out/dist.json --markdown benchmarks/out/dist.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks import bench_core as core
from benchmarks.bench_core import GB, live_tensors

VARIANTS = ("ddp", "fsdp")
SAVES = ("dcp_save", "dcp_async", "stashpoint_save", "stashpoint_async")
LOADS = {
    "dcp_load": "dcp_save",
    "stashpoint_load_exchange": "stashpoint_save",
    "stashpoint_load_direct": "stashpoint_save",
}
DLABELS = dict(core.LABELS, stashpoint_load_exchange="stashpoint.load(exchange=True)")
DLABELS["stashpoint_load_direct"] = "stashpoint.load(exchange=False)"
WORLD = 2


def log(msg: str) -> None:
    who = f" rank {os.environ['RANK']}" if "RANK" in os.environ else ""
    print(f"[bench_dist{who} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def build(variant: str, size_gb: float, seed: int, rank: int) -> dict[str, Any]:
    """bench_core's state; for fsdp the model is sharded with FSDP2 and AdamW re-made and stepped."""
    import torch

    state = core.build_state(core.choose_shape(size_gb), seed)
    if variant == "ddp":
        return state
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = state["model"]
    del state["optim"]  # frees the unsharded moments
    mesh = init_device_mesh("cpu", (WORLD,))
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(seed + 1 + rank)
    for p in model.parameters():
        grad = torch.empty(local(p).shape).normal_(0.0, 1e-3, generator=g)
        p.grad = DTensor.from_local(grad, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    optim.step()
    model.zero_grad(set_to_none=True)
    return {"model": model, "optim": optim, "step": 1000}


def fingerprint(state: dict[str, Any]) -> list[Any]:
    """Per local tensor: ~64 strided samples and the float64 sum; then the step."""
    fp: list[Any] = []
    for t in live_tensors(state):
        flat = local(t).detach().reshape(-1)
        fp.append((flat[:: max(1, flat.numel() // 64)].clone(), float(flat.double().sum())))
    return [*fp, state["step"]]


def same(a: list[Any], b: list[Any]) -> bool:
    import torch

    if len(a) != len(b) or a[-1] != b[-1]:
        return False
    return all(torch.equal(x[0], y[0]) and x[1] == y[1] for x, y in zip(a[:-1], b[:-1], strict=True))


def scramble(state: dict[str, Any]) -> None:
    import torch

    with torch.no_grad():
        for t in live_tensors(state):
            local(t).zero_()
    state["step"] = -1


def bytes_per_rank(method: str, path: Path) -> dict[str, Any]:
    """Data bytes each rank wrote (from file names for DCP, from the manifest for stashpoint)."""
    per: Counter[int] = Counter()
    if method.startswith("dcp"):
        for f in path.glob("*.distcp"):
            if (m := re.fullmatch(r"__(\d+)_\d+\.distcp", f.name)) is None:
                raise RuntimeError(f"unexpected DCP file name {f.name} (rank not recognized)")
            per[int(m.group(1))] += f.stat().st_size
    else:
        for fe in json.loads((path / "manifest.json").read_text())["files"]:
            per[int(fe.get("rank", 0))] += int(fe["size"])
    return {"per_rank": [per[r] for r in range(WORLD)], "total_on_disk": core.tree_bytes(path)}


def stash_loader(state: dict[str, Any], exchange: bool) -> Any:
    import stashpoint

    def load(path: Path) -> dict[str, Any]:
        t0 = time.perf_counter()
        # default timeout, as the saves: stashpoint keeps one checkpoint group per timeout value
        stashpoint.load(state, str(path), exchange=exchange)
        return {"load_s": time.perf_counter() - t0}

    return load


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=_dt.timedelta(seconds=args.op_timeout))
    try:
        t0 = time.perf_counter()
        state = build(args.worker, args.size_gb, args.seed, rank)
        locs = [local(t) for t in live_tensors(state)]
        nbytes = sum(t.numel() * t.element_size() for t in locs)
        out: dict[str, Any] = {"variant": args.worker, "rank": rank, "build_s": time.perf_counter() - t0}
        out.update(local_state_bytes=nbytes, num_tensors=len(locs), torch_threads=torch.get_num_threads())
        out.update(saves={}, loads={})
        del locs
        log(f"{args.worker}: built {out['local_state_bytes'] / GB:.3f} GB local state in {out['build_s']:.1f} s")
        root = Path(args.dir)
        reference = fingerprint(state)
        for method in SAVES:
            out["saves"][method] = run_saves(method, state, args, root=root, rank=rank)
            keep = root / f"{method}-last"
            for name in (n for n, m in LOADS.items() if m == method):
                out["loads"][name] = run_loads(name, state, args, path=keep, rank=rank, reference=reference)
            dist.barrier()
            if rank == 0:
                core.remove(keep)
        return out
    finally:
        dist.destroy_process_group()


def run_saves(method: str, state: dict[str, Any], args: argparse.Namespace, *, root: Path, rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    saver = core.make_saver(method, state, args.op_timeout)
    res: dict[str, Any] = {"records": []}
    for i in range(args.repeats + 1):
        path = root / (f"{method}-last" if i == args.repeats else f"{method}-{i}")
        dist.barrier()  # ranks start together
        rec = saver(path)
        dist.barrier()
        if i == 0:
            res["first"] = rec
        else:
            res["records"].append(rec)
        if rank == 0:
            log(
                f"{method}: save {i}/{args.repeats}: blocking {rec['blocking_s']:.3f}, durable {rec['durable_s']:.3f} s"
            )
            if i == args.repeats:
                res["bytes"] = bytes_per_rank(method, path)
            else:
                core.remove(path)
        dist.barrier()
    return res


def run_loads(
    name: str, state: dict[str, Any], args: argparse.Namespace, *, path: Path, rank: int, reference: list[Any]
) -> list[dict[str, Any]]:
    import torch.distributed as dist

    loader = core.make_loader(name, state) if name == "dcp_load" else stash_loader(state, name.endswith("exchange"))
    records = []
    for i in range(args.repeats):
        scramble(state)
        if rank == 0:
            core.evict_cache(path)  # the page cache is shared: one rank drops the pages for both
        dist.barrier()
        rec = loader(path)
        rec["verified"] = same(fingerprint(state), reference)
        records.append(rec)
        dist.barrier()
        if rank == 0:
            log(f"{name}: load {i + 1}/{args.repeats}: {rec['load_s']:.3f} s, verified={rec['verified']}")
    return records


def launch(variant: str, args: argparse.Namespace, scratch: Path) -> list[dict[str, Any]]:
    """Run one variant on WORLD ranks; each rank's result dict (with "error" on failure)."""
    wdir = scratch / variant
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs, results = [], []
    for rank in range(WORLD):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        opts = ["--worker", variant, "--size-gb", args.size_gb, "--repeats", args.repeats, "--seed", args.seed]
        opts += ["--op-timeout", args.op_timeout, "--dir", wdir, "--result", scratch / f"{variant}-{rank}.json"]
        cmd = [sys.executable, "-m", "benchmarks.bench_dist", *map(str, opts)]
        procs.append(subprocess.Popen(cmd, cwd=core.REPO, env=env, stdout=sys.stderr, stderr=sys.stderr))
    limit = worker_timeout(args)
    deadline = time.monotonic() + limit
    failed_at: float | None = None
    reason = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now  # a rank died: the other is likely stuck in a collective
        if now > deadline or (failed_at is not None and now > failed_at + 30):
            reason = f"timed out after {limit:.0f} s; raise --timeout" if now > deadline else "a peer rank failed"
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            break
        time.sleep(0.5)
    shutil.rmtree(wdir, ignore_errors=True)
    for rank, p in enumerate(procs):
        f = scratch / f"{variant}-{rank}.json"
        res = json.loads(f.read_text()) if f.is_file() else {}
        if p.returncode != 0 and "error" not in res:
            res["error"] = f"rank {rank} exited with status {p.returncode}" + (f" ({reason})" if reason else "")
        results.append(res)
    return results


def worker_timeout(args: argparse.Namespace) -> float:
    if args.timeout:
        return float(args.timeout)
    ops = len(SAVES) * (args.repeats + 1) + len(LOADS) * args.repeats
    return 300.0 + ops * (40.0 * args.size_gb + 20.0)


def worst(per_rank: list[list[dict[str, Any]]], key: str) -> list[float]:
    """Per repeat, the slowest rank's figure."""
    return [max(recs[key] for recs in same_repeat) for same_repeat in zip(*per_rank, strict=True)]


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return {"errors": errors}
    saves: dict[str, Any] = {}
    for m in SAVES:
        per = [r["saves"][m] for r in ranks]
        recs = [p["records"] for p in per]
        blocking, durable = worst(recs, "blocking_s"), worst(recs, "durable_s")
        e = saves[m] = {"label": DLABELS[m], "blocking_s": core.median(blocking), "durable_s": core.median(durable)}
        e.update(first_blocking_s=max(p["first"]["blocking_s"] for p in per), all_blocking_s=blocking)
        e.update(first_durable_s=max(p["first"]["durable_s"] for p in per), all_durable_s=durable)
        e.update(bytes_per_rank=per[0]["bytes"]["per_rank"], total_on_disk=per[0]["bytes"]["total_on_disk"])
        if "lib_bytes_written" in per[0]["records"][-1]:  # SaveStats.bytes_written: the total over ranks
            e["lib_bytes_written"] = per[0]["records"][-1]["lib_bytes_written"]
    for ref, key in (("dcp_save", "vs_dcp_save"), ("dcp_async", "vs_dcp_async")):
        for e in saves.values():
            e[key] = [saves[ref][k] / e[k] if e[k] else None for k in ("blocking_s", "durable_s")]
    loads: dict[str, Any] = {}
    for name in LOADS:
        times = worst([r["loads"][name] for r in ranks], "load_s")
        loads[name] = {"label": DLABELS[name], "load_s": core.median(times), "all_load_s": times}
        loads[name]["verified"] = all(rec["verified"] for r in ranks for rec in r["loads"][name])
    for e in loads.values():
        e["vs_dcp_load"] = loads["dcp_load"]["load_s"] / e["load_s"] if e["load_s"] else None
    out = {"saves": saves, "loads": loads, "local_state_gb": [r["local_state_bytes"] / GB for r in ranks]}
    return dict(out, num_tensors=ranks[0]["num_tensors"], build_s=max(r["build_s"] for r in ranks))


def tables(summaries: dict[str, Any], meta: dict[str, Any]) -> str:
    lines: list[str] = []
    what = {"ddp": "replicated on both ranks (DDP-style)", "fsdp": "sharded with FSDP2 fully_shard (DTensors)"}
    for v, s in summaries.items():
        lines += ["", f"**{v}**: {meta['state_gb']:.2f} GB state {what[v]}"]
        if "errors" in s:
            lines += ["", "failed: " + "; ".join(s["errors"])]
            continue
        lines += [
            f"({', '.join(f'{x:.2f}' for x in s['local_state_gb'])} GB held per rank, {s['num_tensors']} tensors "
            f"per rank; medians of {meta['repeats']} saves after one warm-up, each the max over ranks; speedup = "
            "reference time / this time)",
            "",
            "| method | blocking s | until durable s | GB written rank 0 / rank 1 | GB on disk "
            "| speedup vs dcp.save (block / durable) | speedup vs DCP async (block / durable) |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for e in s["saves"].values():
            sp = [" / ".join(core._f(x, ".2f", "x") for x in e[k]) for k in ("vs_dcp_save", "vs_dcp_async")]
            lines.append(
                f"| {e['label']} | {core._f(e['blocking_s'])} | {core._f(e['durable_s'])} "
                f"| {' / '.join(f'{b / GB:.3f}' for b in e['bytes_per_rank'])} | {e['total_on_disk'] / GB:.3f} "
                f"| {sp[0]} | {sp[1]} |"
            )
        lines += ["", "| load (pages evicted first) | load s | speedup vs dcp.load | verified |", "|---|---:|---:|---|"]
        for e in s["loads"].values():
            lines.append(
                f"| {e['label']} | {core._f(e['load_s'])} | {core._f(e['vs_dcp_load'], '.2f', 'x')} "
                f"| {'yes' if e['verified'] else 'NO'} |"
            )
    lines += [
        "",
        "Hot page cache (each checkpoint deleted just before the next save, no wait). Blocking includes building "
        "the state dict (DCP: `get_state_dict`). GB written per rank: data files only (DCP `__<rank>_*.distcp`; "
        "stashpoint shards by the manifest's writer rank); GB on disk adds DCP's `.metadata` / stashpoint's "
        "manifest (rank 0). Loads read into the live state after `posix_fadvise(DONTNEED)` on every checkpoint "
        "file, each checked against the saved values on every rank. Both ranks share this machine's page cache "
        "and disk, so with `exchange=False` the second reader of a region mostly hits the cache the first one "
        "filled: storage sees each byte about once either way, and `exchange=True` adds the gloo broadcast.",
    ]
    return "\n".join(lines).lstrip()


def orchestrate(args: argparse.Namespace) -> int:
    import psutil
    import torch

    shape = core.choose_shape(args.size_gb)
    base = Path(args.dir) if args.dir else core.default_scratch_base()
    base.mkdir(parents=True, exist_ok=True)
    need_disk, need_ram = 2.5 * shape.state_bytes, WORLD * 3.5 * shape.state_bytes
    if shutil.disk_usage(base).free < need_disk:
        log(f"error: {base} has {shutil.disk_usage(base).free / GB:.1f} GB free; need ~{need_disk / GB:.1f} GB")
        return 2
    if (avail := psutil.virtual_memory().available) < need_ram:
        log(f"warning: {avail / GB:.1f} GB of memory available; the ranks may need ~{need_ram / GB:.1f} GB")
    load1 = os.getloadavg()[0]
    if load1 > 0.5 * (os.cpu_count() or 1):
        log(f"warning: load average {load1:.2f} on {os.cpu_count()} CPUs: figures will be noisy")
    scratch = Path(tempfile.mkdtemp(prefix="stashpoint-bench-dist-", dir=base))
    log(
        f"state {shape.state_bytes / GB:.3f} GB ({shape.layers} x {shape.width}); scratch {scratch}; "
        f"per-variant timeout {worker_timeout(args):.0f} s"
    )
    raw: dict[str, list[dict[str, Any]]] = {}
    try:
        for v in args.variants:
            t0 = time.perf_counter()
            log(f"{v}: launching {WORLD} ranks ...")
            raw[v] = launch(v, args, scratch)
            errs = [r["error"] for r in raw[v] if "error" in r]
            log(f"{v}: {'FAILED: ' + '; '.join(errs) if errs else 'done'} in {time.perf_counter() - t0:.0f} s")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summaries = {v: summarize(r) for v, r in raw.items()}
    try:
        import stashpoint

        sp_version = stashpoint.__version__
    except Exception as e:
        sp_version = f"unavailable ({type(e).__name__}: {e})"
    machine = {"cpus": os.cpu_count(), "ram_gib": psutil.virtual_memory().total / 2**30, "loadavg_start": load1}
    machine.update(platform=platform.platform(), python=platform.python_version(), loadavg_end=os.getloadavg())
    meta = {"date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"), "machine": machine}
    meta.update(command="python -m benchmarks.bench_dist " + " ".join(sys.argv[1:]), world_size=WORLD)
    meta.update(repeats=args.repeats, seed=args.seed, state_gb=shape.state_bytes / GB, shape=asdict(shape))
    meta.update(torch=torch.__version__, stashpoint=sp_version, commit=core.git_commit(), scratch_base=str(base))
    meta["page_cache"] = "hot for saves; loads after posix_fadvise(DONTNEED) of every checkpoint file"
    text = tables(summaries, meta)
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"meta": meta, "summary": summaries, "ranks": raw}, indent=2, default=str) + "\n")
        log(f"wrote {out}")
    if args.markdown:
        sh, mc = meta["shape"], meta["machine"]
        md = (
            f"### Distributed benchmark, {meta['date']}: 2 gloo ranks, one machine, {meta['state_gb']:.2f} GB state\n\n"
            f"{mc['cpus']} CPUs, {mc['ram_gib']:.0f} GiB RAM, torch {meta['torch']}, stashpoint {meta['stashpoint']} "
            f"({meta['commit']}); model {sh['layers']} layers x {sh['width']} wide, vocab {sh['vocab']}, + AdamW after "
            f"one step; OMP_NUM_THREADS=1 per rank; scratch under {meta['scratch_base']}.\n\n{text}\n\n"
            f"Command: `{meta['command']}`\n"
        )
        if args.markdown == "-":
            print("\n" + md)
        else:
            p = Path(args.markdown)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(md)
            log(f"wrote {p}")
    return 1 if any("errors" in s for s in summaries.values()) else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_dist",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--size-gb", type=float, default=1.0, help="training state size: weights + AdamW moments (GB)")
    ap.add_argument("--repeats", type=int, default=2, help="measured saves and loads per method, after one warm-up")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="states to run")
    ap.add_argument("--out", default="benchmarks/out/dist.json", help="JSON results ('' to skip)")
    ap.add_argument("--markdown", default=None, help="write a RESULTS.md-ready block to this file ('-' for stdout)")
    ap.add_argument("--dir", default=None, help="scratch base directory (default: /var/tmp on the repo's disk)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=None, help="seconds per variant (default: from the size)")
    ap.add_argument("--op-timeout", type=float, default=None, help="seconds one collective / async save may wait")
    ap.add_argument("--worker", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.size_gb <= 0 or args.repeats < 1:
        ap.error("--size-gb must be > 0 and --repeats >= 1")
    if args.op_timeout is None:
        args.op_timeout = 120.0 + 120.0 * args.size_gb
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is None:
        return orchestrate(args)
    try:
        res, code = worker(args), 0
    except BaseException as e:  # report every failure, then exit non-zero
        traceback.print_exc()
        res, code = {"variant": args.worker, "error": f"rank {os.environ.get('RANK')}: {type(e).__name__}: {e}"}, 1
    if args.result:
        tmp = Path(args.result + ".tmp")
        tmp.write_text(json.dumps(res, default=str))
        tmp.replace(args.result)
    return code


if __name__ == "__main__":
    sys.exit(main())
