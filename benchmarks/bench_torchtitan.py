"""torchtitan with DCP against torchtitan with stashpoint, on the same job (issue 20).

    python -m benchmarks.bench_torchtitan [--ranks 2] [--steps 13] [--interval 3] [--repeat 2]

torchtitan's own trainer and llama3 debug model on the CPU (tests/titan_job.py, FSDP2 over
``--ranks`` gloo ranks), one job per method, the same data and schedule: a checkpoint every
``--interval`` steps (all kept) and a final model-only save. Methods: no checkpoints (the
baseline), DCP synchronous (``async_mode=disabled``), DCP asynchronous (``async_mode=async``;
``async_with_pinned_mem`` needs a GPU) and stashpoint (``--override.imports
stashpoint.integrations.torchtitan.use_stashpoint``). Per method, the best of ``--repeat`` jobs,
rank 0's view:

- **blocked per save**: how long ``checkpointer.save()`` held the training loop (median over the
  saves before the last step);
- **lost per save**: (the time from the end of step 1 to the end of the last step - the
  baseline's) / those saves: what training lost, background writes' contention included;
- **save to durable**: from the call until the checkpoint was written (DCP's writer fsyncs
  its files) or, for stashpoint, committed (median).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "titan_job.py"
METHODS = {
    "none": [],
    "DCP sync": ["--checkpoint.enable", "--checkpoint.async-mode", "disabled"],
    "DCP async": ["--checkpoint.enable", "--checkpoint.async-mode", "async"],
    "stashpoint": ["--checkpoint.enable", "--override.imports", "stashpoint.integrations.torchtitan.use_stashpoint"],
}


def run(method: str, args: argparse.Namespace, work: Path, port: int) -> dict:
    times = work / f"times-{method.replace(' ', '_')}"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.ranks), f"--master_port={port}",
        str(JOB), "--module", "titan_job", "--config", "debug_cpu", "--training.steps", str(args.steps),
        "--checkpoint.interval", str(args.interval), "--checkpoint.keep-latest-k", "0",
        "--checkpoint.last-save-model-only", "--checkpoint.folder", f"ckpt-{method.replace(' ', '_')}",
        *(["--parallelism.spmd-backend", "full_dtensor"] if args.ranks > 1 else []), *METHODS[method],
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}",
        "OMP_NUM_THREADS": "1",
        "TITAN_TIMES": str(times),
    }
    res = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"{method}: the job exited {res.returncode}:\n{res.stderr[-3000:]}")
    rec = json.loads(Path(f"{times}.0.json").read_text())
    steps = rec["steps"]
    inner = [s for s in rec["saves"] if not s[2] and s[0] < args.steps]
    durable = [d[1] for d in rec["durable"] if d[0] < args.steps]
    return {"loop": steps[-1] - steps[0], "blocked": [s[1] for s in inner], "saves": len(inner), "durable": durable}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=13)
    ap.add_argument("--interval", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from dist_util import free_port
    from titan_job import write_assets

    best: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        work = Path(tmp)
        write_assets(work)
        for _ in range(args.repeat):  # interleaved, so that the machine's drift touches every method alike
            for m in METHODS:
                res = run(m, args, work, free_port())
                if m not in best or res["loop"] < best[m]["loop"]:
                    best[m] = res
        first = work / "outputs" / "ckpt-stashpoint" / f"step-{args.interval:08d}"
        ckpt = sum(f.stat().st_size for f in first.rglob("*") if f.is_file())
    base = best["none"]["loop"]
    saves = best["stashpoint"]["saves"]
    print(
        f"torchtitan llama3 debugmodel, {args.ranks} rank(s) (FSDP2, gloo, CPU), {args.steps} steps, a checkpoint "
        f"every {args.interval} ({saves} before the last step) of {ckpt / 1e6:.0f} MB; "
        f"best of {args.repeat}"
    )
    print("| method | steps 1..last | blocked per save (median) | lost per save | save to durable (median) "
          "| vs stashpoint (lost) |")
    print("|---|---:|---:|---:|---:|---:|")
    lost = {m: max(0.0, (r["loop"] - base) / max(1, r["saves"])) for m, r in best.items() if m != "none"}
    for m, r in best.items():
        if m == "none":
            print(f"| no checkpoints | {r['loop']:.2f} s | - | - | - | - |")
            continue
        ratio = lost[m] / lost["stashpoint"] if lost["stashpoint"] > 0 else float("inf")
        med = statistics.median(r["blocked"]) if r["blocked"] else 0.0
        dur = statistics.median(r["durable"]) if r["durable"] else 0.0
        print(
            f"| {m} | {r['loop']:.2f} s | {med * 1000:.0f} ms | {lost[m] * 1000:.0f} ms | {dur * 1000:.0f} ms "
            f"| {ratio:.1f}x |"
        )


if __name__ == "__main__":
    main()
