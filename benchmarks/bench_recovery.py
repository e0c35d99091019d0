"""Time to resume (issue 21, part 5): two torchrun agents on this host are two nodes.

    python -m benchmarks.bench_recovery [--size-gb 0.5] [--repeats 2] [--tier disk|memory]

The suite's GPT + AdamW under FSDP2 over the two nodes (one rank each) is saved once as step 1
(benchmarks/recovery_worker.py): node-local with one replica, to S3 (a SeaweedFS server this
script starts), and with ``dcp.save`` to this host's disk. Then fresh jobs resume it, each
reporting the load alone and the time from launching torchrun to the end of the first
training step:

- **own tier**: each node's own directory (a restart on the same nodes; the page cache holds
  the files, as after a crash);
- **peer replica**: node 1's directory deleted first (a node lost with its disk): its rank's
  files come from node 0's replica;
- **S3**: a manager whose local root is empty (fresh nodes) and whose remote tier is S3;
- **dcp.load** from the disk, into the same fresh state.

And the training time lost per save, node-local with replicas on and off: 40 steps with saves
at steps 16, 24 and 32, against the same 40 steps without saves (medians over the trials),
divided by the saves; and the CPU time both nodes' processes used per save, the same way (what
the saves cost a host whose cores training keeps busy). ``--cost``: the CPU time of a save
alone, without training (from its call until ``wait()`` returns: durable, and copied), the
saves ``--gap`` seconds apart (default 0: back to back).
``--tier memory`` puts the nodes' directories on ``/dev/shm`` (a memory tier: replicas in the
peers' host memory); S3 and DCP stay on disk. Run it alone: two cores serve both nodes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
WORKER = REPO / "benchmarks" / "recovery_worker.py"
SOURCES = ("own", "replica", "s3", "dcp")


def log(msg: str) -> None:
    print(f"[bench_recovery {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def job(base: Path, phase: str, env: dict[str, str], *extra: str) -> list[dict]:
    from dist_util import free_port

    port = free_port()
    procs = []
    env = {**env, "BENCH_T0": repr(time.time())}
    for node in (0, 1):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
            "--node_rank", str(node), "--rdzv_backend", "c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
            "--rdzv_id", f"rec-{port}", "--max_restarts", "0", str(WORKER), str(base), phase, *extra,
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    for p, out in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"{phase} {extra} failed:\n{out[-4000:]}")
    if env.get("BENCH_LOG"):
        for out in outs:
            sys.stderr.writelines(line + "\n" for line in out.splitlines() if line.startswith("[node "))
    return [json.loads(line[7:]) for out in outs for line in out.splitlines() if line.startswith("RESULT ")]


SAVES = 3  # recovery_worker.py's train phase saves at steps 16, 24 and 32 of 40


def lost_per_save(totals: dict[int, list[float]]) -> dict[int, float]:
    """Per configuration (``--replicas`` 0 or 1), the median of its 40 steps' time (or CPU time)
    beyond the median of the same 40 steps without saving (``--replicas -1``), per save."""
    base = statistics.median(totals[-1])
    return {k: (statistics.median(v) - base) / SAVES for k, v in totals.items() if k >= 0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_recovery", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--size-gb", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sources", default=",".join(SOURCES), help="which restores to time (default: all)")
    ap.add_argument("--no-train", action="store_true", help="skip the training time lost per save")
    ap.add_argument("--cost", action="store_true", help="also the CPU time of a save alone, replicas off and on")
    ap.add_argument("--gap", type=float, default=0.0, help="--cost: seconds between one save's end and the next")
    ap.add_argument("--tier", choices=("disk", "memory"), default="disk",
                    help="where the nodes' directories are: this host's disk, or /dev/shm")  # fmt: skip
    ap.add_argument("--log", action="store_true", help="the workers log stashpoint's INFO lines (to stderr here)")
    args = ap.parse_args(argv)
    sources = [s for s in args.sources.split(",") if s]
    if not set(sources) <= set(SOURCES):
        ap.error(f"--sources: choose from {', '.join(SOURCES)}")
    from s3_server import SeaweedServer

    base = Path(tempfile.mkdtemp(prefix="bench-recovery-", dir="/var/tmp"))
    nodes = Path(tempfile.mkdtemp(prefix="bench-recovery-", dir="/dev/shm")) if args.tier == "memory" else base
    server = SeaweedServer(base / "weed")
    server.start()
    try:
        server.create_bucket("bench")
        env = {**os.environ, **server.env(), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
               "BENCH_LOG": "1" if args.log else "", "BENCH_NODES": str(nodes)}  # fmt: skip
        common = ("--size-gb", str(args.size_gb), "--s3", "s3://bench/run")
        log("saving step 1 (node-local with a replica, S3, DCP)")
        job(base, "save", env, *common)
        nbytes = sum(p.stat().st_size for p in (base / "dcp").rglob("*") if p.is_file())
        results: dict[str, list[tuple[float, float, float]]] = {s: [] for s in sources}
        for trial in range(args.repeats):
            for source in sources:
                if source == "replica":  # node 1's directory gone (renamed: copying it would leave
                    # 0.25 GB of dirty pages that the restore's writes then wait behind)
                    (nodes / "node-1").rename(nodes / "node-1.kept")
                got = job(base, "resume", env, *common, "--source", source)
                if source == "replica":
                    shutil.rmtree(nodes / "node-1")
                    (nodes / "node-1.kept").rename(nodes / "node-1")
                load = max(r["load_s"] for r in got)
                first = max(r["to_first_step_s"] for r in got)
                step = max(r["first_step_s"] for r in got)
                results[source].append((load, first, step))
                log(f"trial {trial + 1}: {source}: load {load:.2f} s, launch to first step {first:.2f} s, "
                    f"the step {step:.2f} s")  # fmt: skip
        totals: dict[int, list[float]] = {}
        cpu: dict[int, list[float]] = {}  # both nodes' processes together
        for trial in range(0 if args.no_train else args.repeats):
            for replicas in (-1, 0, 1):  # -1: the same steps, no saves
                shutil.rmtree(nodes / "node-0", ignore_errors=True)
                shutil.rmtree(nodes / "node-1", ignore_errors=True)
                got = job(base, "train", env, *common, "--replicas", str(replicas))
                totals.setdefault(replicas, []).append(max(sum(r["step_s"]) for r in got))
                cpu.setdefault(replicas, []).append(sum(r["cpu_s"] for r in got))
                log(f"trial {trial + 1}: replicas={replicas}: 40 steps in {totals[replicas][-1]:.2f} s, "
                    f"{cpu[replicas][-1]:.2f} CPU s")  # fmt: skip
        lost = lost_per_save(totals) if totals else {}
        cost: dict[int, list[tuple[float, float]]] = {}  # replicas -> (CPU s, wall s) of each save, per node
        by_thread: dict[int, dict[str, float]] = {}  # replicas -> thread name -> CPU s, summed
        for _ in range(args.repeats if args.cost else 0):
            for replicas in (0, 1):
                shutil.rmtree(nodes / "node-0", ignore_errors=True)
                shutil.rmtree(nodes / "node-1", ignore_errors=True)
                for r in job(base, "cost", env, *common, "--replicas", str(replicas), "--gap", str(args.gap)):
                    cost.setdefault(replicas, []).extend(zip(r["save_cpu_s"], r["save_s"]))
                    into = by_thread.setdefault(replicas, {})
                    for name, s in r["threads_cpu_s"].items():
                        into[name] = into.get(name, 0.0) + s
        cpu_lost = lost_per_save(cpu) if cpu else {}
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(nodes, ignore_errors=True)
    print(f"{nbytes / 1e9:.2f} GB state (FSDP2 over 2 nodes x 1 rank), the nodes' directories on {args.tier}; "
          f"median of {args.repeats} trials\n")  # fmt: skip
    print("| restore from | load | launch to first step | the first step alone |")
    print("|---|---:|---:|---:|")
    names = {"own": "the node's own tier", "replica": "a peer's replica (node 1 lost)", "s3": "S3 (SeaweedFS)",
             "dcp": "`dcp.load` from disk"}  # fmt: skip
    for s in sources:
        load, first, step = (statistics.median(t[i] for t in results[s]) for i in range(3))
        print(f"| {names[s]} | {load:.2f} s | {first:.2f} s | {step:.2f} s |")
    if lost:
        ratio = f" ({lost[1] / lost[0]:.2f}x)" if lost[0] > 0 else ""
        print(f"\ntraining time lost per save: replicas off {lost[0]:.3f} s, on {lost[1]:.3f} s{ratio}")
        ratio = f" ({cpu_lost[1] / cpu_lost[0]:.2f}x)" if cpu_lost[0] > 0 else ""
        print(f"CPU time per save (both nodes): replicas off {cpu_lost[0]:.3f} s, on {cpu_lost[1]:.3f} s{ratio}")
    for replicas, got in sorted(cost.items()):
        cpu_s, wall = statistics.median(c for c, _ in got), statistics.median(w for _, w in got)
        print(f"a save alone, replicas={replicas}: {cpu_s:.3f} CPU s per node, {wall:.3f} s until wait() returned "
              f"(median of {len(got)}, {args.gap:g} s apart)")  # fmt: skip
        busy = sorted(by_thread[replicas].items(), key=lambda kv: -kv[1])
        ended = sum(c for c, _ in got) - sum(s for _, s in busy)  # threads gone before the save's end
        parts = [f"{n} {s / len(got):.3f}" for n, s in busy if s > 0] + [f"threads that ended {ended / len(got):.3f}"]
        print("  per save and node, by thread name (Python's all show as `python`): " + ", ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
