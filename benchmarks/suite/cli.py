"""``python -m benchmarks``: every method side by side on the same states; JSON, markdown, PNGs.

For each configuration (ranks x layout x state size) the suite measures the references once per
regime (raw disk bandwidth for the state's byte count, the copy floor), then runs every method
in its own process(es), once per page-cache regime: saves (blocking, until the state is free,
until durable, throughput, peak extra host memory), then, in the first regime's run only, loads
(after evicting the checkpoint's pages) and the training-loop experiment (step times while
checkpointing every K steps). Methods that cannot run here are listed with the reason; a method
that fails is reported with its error. See benchmarks/README.md.

    python -m benchmarks --sizes 0.5 2 --ranks 1 2 --regimes cold hot --out benchmarks/out/suite
    python -m benchmarks --quick --ranks 1            # a smoke test of the harness, a few minutes
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import plots, report
from .common import COLD_SLEEP_S, GB, default_scratch_base, git_commit, log, machine_info, versions
from .launch import launch
from .methods import GROUPS, METHODS, OK, SAVE_METHODS, availability, expand
from .state import choose_shape
from .summary import method_entry, targets

QUICK = {
    "sizes": [0.03],
    "repeats": 1,
    "cold_sleep": 1.0,
    "every": 5,
    "checkpoints": 2,
    "baseline": 10,
    "step_ms": 20.0,
}
FULL = {"sizes": [0.5, 2.0, 4.0], "repeats": 2, "cold_sleep": COLD_SLEEP_S, "every": 30, "checkpoints": 3,
        "baseline": 30, "step_ms": 75.0}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", type=float, nargs="+", help="state sizes in GB (default 0.5 2 4; --quick: 0.03)")
    ap.add_argument("--ranks", type=int, nargs="+", choices=(1, 2), default=[1, 2], help="process counts (default 1 2)")
    ap.add_argument(
        "--layouts", nargs="+", choices=("fsdp", "ddp"), default=["fsdp", "ddp"],
        help="how 2 ranks hold the state: FSDP2-sharded, or replicated as with DDP (default both)",
    )  # fmt: skip
    ap.add_argument(
        "--methods", nargs="+", default=["all"], metavar="NAME",
        help=f"methods or groups (default all). Methods: {', '.join(SAVE_METHODS)}. Groups: {', '.join(GROUPS)}",
    )  # fmt: skip
    ap.add_argument("--regimes", nargs="+", choices=("cold", "hot"), default=["cold", "hot"],
                    help="page-cache regimes of the saves (default cold hot; see benchmarks/README.md)")  # fmt: skip
    ap.add_argument("--repeats", type=int, help="measured saves and loads per method, after a warm-up (default 2)")
    ap.add_argument("--quick", action="store_true", help="tiny states, one repeat, short waits: a smoke test")
    ap.add_argument("--out", default="benchmarks/out/suite", help="directory for results.json, results.md, PNGs")
    ap.add_argument("--dir", default=None, help="scratch base (default /var/tmp, on the repository's disk)")
    ap.add_argument("--every", type=int, help="training loop: a checkpoint every K steps (default 30)")
    ap.add_argument("--checkpoints", type=int, help="training loop: checkpoints per run (default 3)")
    ap.add_argument("--baseline", type=int, help="training loop: undisturbed steps first (default 30)")
    ap.add_argument("--step-ms", type=float, help="training loop: target step time in ms (default 75)")
    ap.add_argument("--cold-sleep", type=float, help=f"seconds a cold save waits (default {COLD_SLEEP_S:g})")
    ap.add_argument("--no-loads", action="store_true", help="skip the loads")
    ap.add_argument(
        "--load-regime", choices=("fresh-node", "same-node"), default="fresh-node",
        help="the loads' page cache: evicted first (a fresh node, the default), or as the save and --idle seconds "
        "left it (a process restarted on the same node)",
    )  # fmt: skip
    ap.add_argument("--idle", type=float, default=12.0, help="same-node loads: seconds between the save and the loads")
    ap.add_argument("--no-steps", action="store_true", help="skip the training-loop experiment")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=None, help="seconds per worker (default: from the size)")
    ap.add_argument("--op-timeout", type=float, default=None, help="seconds one save or collective may take")
    ap.add_argument("--list", action="store_true", help="list the methods and whether each can run here, then exit")
    ap.add_argument(
        "--from", dest="from_json", nargs="+", metavar="RESULTS_JSON",
        help="measure nothing: render --out from earlier runs' results.json (configurations joined, targets "
        "recomputed)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    for key, full in FULL.items():
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else full)
    try:
        args.methods = expand(args.methods)
    except ValueError as e:
        ap.error(str(e))
    if any(s <= 0 for s in args.sizes) or args.repeats < 1 or args.every < 1 or args.checkpoints < 1:
        ap.error("--sizes must be > 0; --repeats, --every and --checkpoints >= 1")
    if args.op_timeout is None:
        args.op_timeout = 120.0 + 120.0 * max(args.sizes)
    return args


def list_methods() -> int:
    for name, m in METHODS.items():
        where = {w: availability(m, w, "single" if w == 1 else "fsdp") for w in (1, 2)}
        state = "; ".join(f"{w} rank(s): {'ok' if a is None else a[1]}" for w, a in where.items())
        print(f"{name:26} {m.label}\n{'':26} {state}")
    return 0


def worker_timeout(args: argparse.Namespace, size: float, phases: list[str]) -> float:
    if args.timeout:
        return float(args.timeout)
    per_op = 60.0 * size + 20.0
    ops: int = args.repeats + 1 + (args.repeats if "loads" in phases else 0)
    t = 120.0 + 60.0 * size + ops * per_op + float(args.repeats * args.cold_sleep) + args.idle
    if "steps" in phases:
        t += args.checkpoints * per_op + 4 * (args.baseline + args.every * args.checkpoints) * args.step_ms / 1e3
    return t


def _common_args(args: argparse.Namespace, size: float, regime: str, scratch: Path, tag: str) -> list[str]:
    return [
        *("--size-gb", f"{size:g}", "--regime", regime, "--repeats", str(args.repeats)),
        *("--cold-sleep", f"{args.cold_sleep:g}", "--seed", str(args.seed), "--op-timeout", f"{args.op_timeout:g}"),
        *("--dir", str(scratch / tag), "--load-regime", args.load_regime, "--idle", f"{args.idle:g}"),
    ]


def references(args: argparse.Namespace, size: float, scratch: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The raw disk per regime, and the copy floor (measured with the first regime)."""
    disks: dict[str, Any] = {}
    floor = None
    for i, regime in enumerate(args.regimes):
        tag = f"reference-{size:g}gb-{regime}"
        log(f"references for {size:g} GB, {regime}: raw disk{' and copy floor' if i == 0 else ''} ...")
        wargs = ["--method", "reference", *_common_args(args, size, regime, scratch, tag)] + (
            ["--floor"] if i == 0 else []
        )
        res = launch(wargs, 1, scratch, tag, worker_timeout(args, size, []))[0]
        disks[regime] = res.get("disk") or {"error": res.get("error", "no result")}
        if i == 0:
            floor = res.get("floor") or {"error": res.get("error", "no result")}
    return disks, floor


def run_config(
    args: argparse.Namespace, ranks: int, layout: str, size: float, *, refs: Any, scratch: Path, batch: int
) -> dict[str, Any]:
    """Every method of ``args.methods`` on one configuration; its entry for the JSON document."""
    shape = choose_shape(size)
    disks, floor = refs
    cfg: dict[str, Any] = {"ranks": ranks, "layout": layout, "size_gb": size, "state_bytes": shape.state_bytes}
    cfg.update(num_tensors=4 * shape.num_param_tensors, repeats=args.repeats, saves_regimes=list(args.regimes))
    cfg.update(load_regime=args.load_regime)
    cfg.update(disk=disks, floor=floor, batch=batch, methods={})
    width = 1024 if size >= 0.25 else 256
    for name in args.methods:
        m = METHODS[name]
        why = availability(m, ranks, layout, no_steps=args.no_steps)
        if why is not None:
            cfg["methods"][name] = {
                "label": m.label, "kind": m.kind, "status": why[0], "reason": why[1], "note": m.note
            }  # fmt: skip
            log(f"{name}: {why[0]}: {why[1]}")
            continue
        by_regime: dict[str, list[dict[str, Any]]] = {}
        for i, regime in enumerate(args.regimes):
            if m.kind == "reference":  # the training loop only, once
                if i > 0:
                    break
                phases = ["steps"]
            else:
                phases = ["saves"]
                if i == 0:
                    phases += ([] if args.no_loads else ["loads"]) + ([] if args.no_steps else ["steps"])
            tag = f"{name}-{ranks}r-{layout}-{size:g}gb-{regime}"
            wargs = ["--method", name, "--layout", layout, *_common_args(args, size, regime, scratch, tag)]
            wargs += ["--phases", ",".join(phases), "--every", str(args.every), "--checkpoints", str(args.checkpoints)]
            wargs += ["--baseline", str(args.baseline), "--batch", str(batch), "--mlp-width", str(width)]
            log(f"{name} on {ranks} rank(s), {layout}, {size:g} GB, {regime}: {'+'.join(phases)} ...")
            t0 = time.perf_counter()
            by_regime[regime] = launch(wargs, ranks, scratch, tag, worker_timeout(args, size, phases))
            errs = sorted({r["error"] for r in by_regime[regime] if "error" in r})
            verdict = "FAILED: " + "; ".join(errs) if errs else "done"
            log(f"{name} {regime}: {verdict} in {time.perf_counter() - t0:.0f} s")
            shutil.rmtree(scratch / tag, ignore_errors=True)
        cfg["methods"][name] = method_entry(name, by_regime, shape.state_bytes, disks)
    cfg["targets"] = targets(cfg, list(args.regimes))
    return cfg


def preflight(args: argparse.Namespace, base: Path) -> None:
    """Refuse a run the disk cannot hold; warn when memory is short or the machine is busy."""
    import psutil

    biggest = choose_shape(max(args.sizes)).state_bytes
    need_disk = (args.checkpoints + 2) * biggest
    free = shutil.disk_usage(base).free
    if free < need_disk:
        raise SystemExit(
            f"error: {base} has {free / GB:.1f} GB free; a {biggest / GB:.1f} GB state needs about "
            f"{need_disk / GB:.1f} GB (pass --dir on a larger disk, or smaller --sizes)"
        )
    # state + staged copy + allocator slack per process; replicated (DDP) states are held by every rank
    need_ram = 3.5 * biggest * (2 if 2 in args.ranks and "ddp" in args.layouts else 1)
    if (avail := psutil.virtual_memory().available) < need_ram:
        log(f"warning: {avail / GB:.1f} GB of memory available; the biggest state needs ~{need_ram / GB:.1f} GB")
    load1 = os.getloadavg()[0]
    if load1 > 0.5 * (os.cpu_count() or 1):
        log(f"warning: load average {load1:.2f} on {os.cpu_count()} CPUs: the figures will be noisy")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        return list_methods()
    if args.from_json:
        return render(args.from_json, Path(args.out))
    from .steptime import calibrate_batch

    base = (Path(args.dir) if args.dir else default_scratch_base()).resolve()  # the workers run in the repo
    base.mkdir(parents=True, exist_ok=True)
    preflight(args, base)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started, t_start = _dt.datetime.now().astimezone(), time.perf_counter()
    meta: dict[str, Any] = {"date": started.isoformat(timespec="seconds"), "commit": git_commit()}
    meta.update(command="python -m benchmarks " + " ".join(sys.argv[1:] if argv is None else argv))
    meta.update(machine=machine_info(), versions=versions(), loadavg_start=os.getloadavg(), scratch_base=str(base))
    meta["options"] = {k: v for k, v in vars(args).items() if k not in ("list",)}
    doc: dict[str, Any] = {"meta": meta, "configs": []}
    scratch = Path(tempfile.mkdtemp(prefix="stashpoint-suite-", dir=base))
    configs = [(1, "single")] if 1 in args.ranks else []
    configs += [(2, layout) for layout in args.layouts] if 2 in args.ranks else []
    refs: dict[float, Any] = {}
    batches: dict[int, int] = {}
    try:
        for ranks, layout in configs:
            if ranks not in batches and not args.no_steps:
                width = 1024 if min(args.sizes) >= 0.25 else 256
                batches[ranks], ms = calibrate_batch(width, args.step_ms, max(1, (os.cpu_count() or 2) // ranks))
                log(f"training loop on {ranks} rank(s): batch {batches[ranks]} (~{ms:.0f} ms a step)")
            for size in args.sizes:
                if size not in refs:
                    refs[size] = references(args, size, scratch)
                doc["configs"].append(
                    run_config(
                        args, ranks, layout, size, refs=refs[size], scratch=scratch, batch=batches.get(ranks, 64)
                    )
                )
                _write(doc, out, t_start)  # what is done so far survives an interrupted run
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    why_not = plots.available()
    if why_not is None:
        doc["plots"] = plots.write_all(doc, out)
    else:
        doc["plots_skipped"] = why_not
        log(why_not)
    md = _write(doc, out, t_start)
    print(md)
    log(f"wrote {out / 'results.json'}, {out / 'results.md'}" + "".join(f", {out / p}" for p in doc.get("plots", [])))
    bad = [
        f"{n} ({c['ranks']} rank(s), {c['size_gb']:g} GB)"
        for c in doc["configs"] for n, e in c["methods"].items()
        if n.startswith("stashpoint") and e["status"] not in (OK, "not available")
    ]  # fmt: skip
    bad += [
        f"raw disk ({c['size_gb']:g} GB, {regime})"
        for c in doc["configs"]
        for regime, d in c["disk"].items()
        if "error" in d
    ]
    if bad:
        log("failed: " + ", ".join(bad))
    return 1 if bad else 0


def _write(doc: dict[str, Any], out: Path, t_start: float | None) -> str:
    if t_start is not None:
        doc["meta"]["loadavg_end"] = os.getloadavg()
        doc["meta"]["wall_s"] = time.perf_counter() - t_start
    (out / "results.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    md = report.markdown(doc)
    (out / "results.md").write_text(md)
    return md


def join_configs(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The configurations of several runs' results, in order. A configuration (ranks, layout,
    size) met again takes the later run's figures of each method that ran there — per regime of
    its saves, its loads, its training loop — and records which (``remeasured``: method -> the
    command of the run its figures now come from, also for a method only that run measured);
    the references stay the first run's."""
    joined: dict[tuple[Any, ...], dict[str, Any]] = {}
    for d in docs:
        command = d["meta"].get("command") or "; ".join(r.get("command", "") for r in d["meta"].get("runs", []))
        for cfg in d["configs"]:
            key = (cfg["ranks"], cfg["layout"], cfg["size_gb"])
            base = joined.setdefault(key, cfg)
            if base is cfg:
                continue
            for name, entry in cfg["methods"].items():
                if entry.get("status") != OK:
                    continue
                into = base["methods"].setdefault(name, entry)
                if into is not entry:
                    into.setdefault("saves", {}).update(entry.get("saves") or {})
                    into.update({part: entry[part] for part in ("load", "steps") if entry.get(part)})
                    into["status"] = OK
                base.setdefault("remeasured", {})[name] = command
    return list(joined.values())


def render(sources: list[str], out: Path) -> int:
    """Join earlier runs' results into one report in ``out`` (JSON, markdown, plots), measuring
    nothing; each run's machine, load average and command are kept, the targets recomputed
    (see :func:`join_configs` for a configuration measured in several runs)."""
    docs = [json.loads(Path(p).read_text()) for p in sources]
    runs = [r for d in docs for r in (d["meta"].get("runs") or [d["meta"]])]
    doc: dict[str, Any] = {"meta": {"runs": runs}, "configs": join_configs(docs)}
    for cfg in doc["configs"]:
        cfg["targets"] = targets(cfg, cfg["saves_regimes"])
    out.mkdir(parents=True, exist_ok=True)
    why_not = plots.available()
    if why_not is None:
        doc["plots"] = plots.write_all(doc, out)
    else:
        doc["plots_skipped"] = why_not
        log(why_not)
    print(_write(doc, out, None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
