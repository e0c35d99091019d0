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
- **lost per save**: how much longer the step that holds a save (from the end of the step the
  save follows to the end of the next) took than the run's median step of the others: the
  blocking call and the background write's contention (a write here ends well within a step),
  measured within each run, free of the drift between runs (the run without checkpoints, at
  the same steps, shows what the measure gives for no saves at all);
- **save to durable**: from the call until the checkpoint was written (DCP's writer fsyncs
  its files) or, for stashpoint, committed (median).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
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
    times = work.resolve() / f"times-{method.replace(' ', '_')}"
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
    folder = work / "outputs" / f"ckpt-{method.replace(' ', '_')}"
    shutil.rmtree(folder, ignore_errors=True)  # each job starts afresh (a checkpoint there would be resumed)
    res = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"{method}: the job exited {res.returncode}:\n{res.stderr[-3000:]}")
    first = folder / f"step-{args.interval:08d}"  # stashpoint's name for the first checkpoint
    size = sum(f.stat().st_size for f in first.rglob("*") if f.is_file()) if first.exists() else 0
    shutil.rmtree(folder, ignore_errors=True)
    rec = json.loads(Path(f"{times}.0.json").read_text())
    steps = rec["steps"]
    inner = [s for s in rec["saves"] if not s[2] and s[0] < args.steps]
    if method == "none":  # the same steps, for the noise of the measure
        inner = [[s, 0.0, 0.0] for s in range(args.interval, args.steps, args.interval)]
    durable = [d[1] for d in rec["durable"] if d[0] < args.steps]
    # steps[k] is the end of step k + 1: a save at step s falls between the ends of steps s and s + 1
    after = {int(s[0]) for s in inner}
    hit = [steps[s] - steps[s - 1] for s in after if s < len(steps)]
    rest = [steps[k] - steps[k - 1] for k in range(1, len(steps)) if k not in after]
    lost = (statistics.mean(hit) - statistics.median(rest)) * len(hit) if hit else 0.0
    durations = [b - a for a, b in itertools.pairwise(steps)]
    return {
        "step": statistics.median(durations),
        "lost": lost,
        "blocked": [s[1] for s in inner if method != "none"],
        "saves": len(inner),
        "durable": durable,
        "bytes": size,
    }


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
                if m not in best or res["lost"] < best[m]["lost"]:
                    best[m] = res
    saves, ckpt = best["stashpoint"]["saves"], best["stashpoint"]["bytes"]
    print(
        f"torchtitan llama3 debugmodel, {args.ranks} rank(s) (FSDP2, gloo, CPU), {args.steps} steps, a checkpoint "
        f"every {args.interval} ({saves} before the last step) of {ckpt / 1e6:.0f} MB; best of {args.repeat}"
    )
    print("| method | median step | blocked per save (median) | lost per save | save to durable (median) "
          "| vs stashpoint (lost) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    lost = {m: r["lost"] / max(1, r["saves"]) for m, r in best.items()}
    for m, r in best.items():
        if m == "none":
            noise = r["lost"] / max(1, saves) * 1000
            print(f"| no checkpoints | {r['step'] * 1000:.0f} ms | - | {noise:.0f} ms (noise) | - | - |")
            continue
        ratio = lost[m] / lost["stashpoint"] if lost["stashpoint"] > 0 else float("inf")
        med = statistics.median(r["blocked"]) if r["blocked"] else 0.0
        dur = statistics.median(r["durable"]) if r["durable"] else 0.0
        print(
            f"| {m} | {r['step'] * 1000:.0f} ms | {med * 1000:.0f} ms | {lost[m] * 1000:.0f} ms | {dur * 1000:.0f} ms "
            f"| {ratio:.1f}x |"
        )


if __name__ == "__main__":
    main()
