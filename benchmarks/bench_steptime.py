"""Step-time benchmark: how much a background persist slows the training loop, thread writer
against process writer.

A training-like loop (an MLP forward, backward and SGD step on 2 intra-op threads, calibrated to
``--step-ms``) runs without pause. Each trial deletes the previous checkpoint, runs undisturbed
steps (the baseline), calls ``stashpoint.async_save`` of a separate realistic state (a GPT-style
model's weights + AdamW after one step, ``--size-gb``, the state of ``bench_core``) and keeps
stepping until the save is durable. Reported per writer and page-cache regime (see
benchmarks/README.md; ``cold`` waits 10 s after deleting the previous checkpoint, while
the baseline steps run, ``hot`` does not):

* ``ratio``: the mean time of the steps that ran entirely during the persist, over the median
  undisturbed step (1.0 = no slowdown);
* ``lost_s``: net training time lost per checkpoint — the wall time from the call until the end
  of the step in which the save became durable, minus the undisturbed time of the steps done in
  it (the staging stall included);
* ``blocking_s``, ``persist_s`` (until durable), and for reference a blocking ``stashpoint.save``
  (``--methods sync``), which loses its whole duration;
* ``foreign_cpu``: the share of the machine's CPU other processes took during the trial. The
  summary gives the medians of all trials and of the quiet ones (at most ``QUIET``).

Trials alternate the methods (paired, same conditions). One process for everything; the load
average at the start and end is recorded (other work on the machine disturbs the figures).

    python -m benchmarks.bench_steptime --size-gb 1.5 --repeats 3 --out benchmarks/out/steptime.json
    # quick check of the harness itself (~30 s):
    python -m benchmarks.bench_steptime --size-gb 0.2 --repeats 1 --regimes hot --out ''
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_core import build_state, choose_shape, default_scratch_base, git_commit

METHODS = ("thread", "process", "sync", "thread-1", "process-1")
# "-1": the same writer through LocalStorage(path, write_streams=1): one shard file at a time
DEFAULT_METHODS = ("thread", "process", "sync")
COLD_SLEEP_S = 10.0
BASELINE_STEPS = 12
QUIET = 0.1  # a trial is "quiet" when other processes took at most this share of the CPU


def log(msg: str) -> None:
    print(f"[bench_steptime {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Trainer:
    """An MLP training step: forward, backward and SGD on a fixed batch, many small ops and a
    few large matmuls, like a real step at small scale."""

    def __init__(self, width: int, depth: int, batch: int, threads: int) -> None:
        import torch
        from torch import nn

        torch.set_num_threads(threads)
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
        self.model = nn.Sequential(*layers)
        self.optim = torch.optim.SGD(self.model.parameters(), lr=1e-4, momentum=0.9)
        self.width = width
        self.x = torch.randn(batch, width)

    def resize(self, batch: int) -> None:
        import torch

        self.x = torch.randn(batch, self.width)

    def step(self) -> float:
        """One step; its duration in seconds."""
        t0 = time.perf_counter()
        self.model(self.x).square().mean().backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        return time.perf_counter() - t0


def calibrate(trainer: Trainer, target_s: float) -> tuple[int, float]:
    """Choose the batch so that a step takes about ``target_s``; (batch, measured step s).

    Each round changes the batch by at most 2x, so one disturbed measurement cannot send it far.
    """
    batch = trainer.x.shape[0]
    t = target_s
    for _ in range(8):
        for _ in range(3):
            trainer.step()
        t = statistics.median(trainer.step() for _ in range(7))
        if abs(t - target_s) / target_s < 0.1:
            break
        batch = max(16, round(batch * min(2.0, max(0.5, target_s / t))))
        trainer.resize(batch)
    return batch, t


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores; /proc/stat, not idle or iowait)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0
    return (sum(fields[:8]) - fields[3] - fields[4]) / _TICK


def _own_cpu_s() -> float:
    """CPU seconds of this process and of the writer process (if any)."""
    from stashpoint._save import writerproc as _writerproc

    t = os.times()
    own = t.user + t.system
    pid = _writerproc.current_pid()
    if pid is not None:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            own += (int(stat[11]) + int(stat[12])) / _TICK
        except (OSError, IndexError, ValueError):
            pass
    return own


class Foreign:
    """The share of the machine's CPU taken by other processes between start and stop."""

    def __init__(self) -> None:
        self.t, self.busy, self.own = time.perf_counter(), _busy_s(), _own_cpu_s()

    def share(self) -> float:
        wall = time.perf_counter() - self.t
        other = (_busy_s() - self.busy) - (_own_cpu_s() - self.own)
        return max(0.0, other) / (wall * (os.cpu_count() or 1)) if wall > 0 else 0.0


def trial(
    trainer: Trainer, state: dict[str, Any], path: Path, *, method: str, regime: str, op_timeout: float
) -> dict[str, Any]:
    import stashpoint
    from stashpoint._storage import LocalStorage

    if path.exists():
        shutil.rmtree(path)
    t_deleted = time.perf_counter()
    base: list[float] = []
    if regime == "cold":  # train while waiting; the baseline is the last undisturbed steps
        while time.perf_counter() - t_deleted < COLD_SLEEP_S:
            base.append(trainer.step())
    for _ in range(BASELINE_STEPS):
        base.append(trainer.step())
    base_s = statistics.median(base[-BASELINE_STEPS:])
    load1 = os.getloadavg()[0]
    foreign = Foreign()

    t0 = time.perf_counter()
    if method == "sync":
        stats = stashpoint.save(state, path)
        handle = None
    else:
        writer, _, streams = method.partition("-")
        target = LocalStorage(path, write_streams=int(streams)) if streams else path
        handle = stashpoint.async_save(state, target, writer=writer)
    t_returned = time.perf_counter()
    steps: list[tuple[float, float]] = []  # (start, end) of each step after the call
    while handle is not None and not handle.done():
        s = time.perf_counter()
        trainer.step()
        steps.append((s, time.perf_counter()))
        if s - t0 > op_timeout:
            raise TimeoutError(f"the {method} save did not finish in {op_timeout} s")
    t_durable = time.perf_counter()
    if handle is not None:
        stats = handle.wait()
    t_end = steps[-1][1] if steps else t_durable
    foreign_share = foreign.share()
    inside = [e - s for s, e in steps if e <= t_durable]  # steps that ran entirely during the persist
    lost = (max(t_end, t_durable) - t0) - len(steps) * base_s
    rec = {
        "method": method,
        "regime": regime,
        "base_step_s": base_s,
        "blocking_s": t_returned - t0,
        "durable_s": t_durable - t0,
        "persist_s": stats.persist_s,
        "steps_during": len(inside),
        "mean_step_during_s": statistics.fmean(inside) if inside else None,
        "max_step_during_s": max(inside) if inside else None,
        "ratio": statistics.fmean(inside) / base_s if inside else None,
        "lost_s": lost,
        "writer": stats.writer if method != "sync" else "thread",
        "bytes": stats.bytes_written,
        "loadavg1": load1,
        "foreign_cpu": foreign_share,
    }
    ratio = f"{rec['ratio']:.2f}x" if rec["ratio"] is not None else "-"
    log(
        f"{regime:4s} {method:7s}: blocked {rec['blocking_s'] * 1e3:6.1f} ms, durable {rec['durable_s']:.2f} s, "
        f"step {base_s * 1e3:.0f} ms -> {ratio} over {len(inside)} steps, lost {lost:.2f} s "
        f"(load {load1:.1f}, other processes {foreign_share:.0%} of the CPU)"
    )
    return rec


def summarize(trials: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for regime in sorted({t["regime"] for t in trials}):
        for method in METHODS:
            ts = [t for t in trials if t["regime"] == regime and t["method"] == method]
            if not ts:
                continue

            def med(key: str, ts: list[dict[str, Any]] = ts) -> float | None:
                xs = [t[key] for t in ts if t[key] is not None]
                return statistics.median(xs) if xs else None

            keys = ("ratio", "lost_s", "blocking_s", "durable_s", "base_step_s", "max_step_during_s", "foreign_cpu")
            clean = [t for t in ts if t["foreign_cpu"] <= QUIET]
            out[f"{regime}/{method}"] = (
                {k: med(k) for k in keys}
                | {"n": len(ts), "n_quiet": len(clean)}
                | {f"quiet_{k}": med(k, clean) for k in ("ratio", "lost_s", "durable_s")}
            )
    return out


def table(summary: dict[str, Any]) -> str:
    rows = [
        "| regime / method | step-time ratio during persist | net training time lost | blocking | until durable "
        "| trials (quiet) | quiet trials: ratio, lost |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, s in summary.items():

        def f(x: float | None, fmt: str) -> str:
            return "-" if x is None else format(x, fmt)

        rows.append(
            f"| {name} | {f(s['ratio'], '.2f')}x | {f(s['lost_s'], '.2f')} s | "
            f"{f(s['blocking_s'] * 1e3, '.0f')} ms | {f(s['durable_s'], '.2f')} s | {s['n']} ({s['n_quiet']}) | "
            f"{f(s['quiet_ratio'], '.2f')}x, {f(s['quiet_lost_s'], '.2f')} s |"
        )
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=1.5, help="size of the saved state (default 1.5)")
    p.add_argument("--repeats", type=int, default=3, help="trials per method and regime (default 3)")
    p.add_argument("--regimes", nargs="+", choices=("cold", "hot"), default=["cold", "hot"])
    p.add_argument(
        "--methods",
        nargs="+",
        choices=METHODS,
        default=list(DEFAULT_METHODS),
        help="writers (default thread process sync); thread-1 / process-1: one write stream",
    )
    p.add_argument("--step-ms", type=float, default=75.0, help="target step time (default 75 ms)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads of the training loop (default 2)")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--dir", type=Path, default=None, help="scratch base (default /var/tmp; removed afterwards)")
    p.add_argument("--op-timeout", type=float, default=300.0)
    p.add_argument("--out", default="benchmarks/out/steptime.json", help="JSON output ('' for none)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    import stashpoint

    load_start = os.getloadavg()
    if load_start[0] > 1.0:
        log(f"warning: load average {load_start[0]:.2f}: other work on the machine disturbs step times")
    shape = choose_shape(args.size_gb)
    log(f"building a {shape.state_bytes / 1e9:.2f} GB state ({shape})")
    state = build_state(shape, seed=0)
    trainer = Trainer(args.width, args.depth, batch=256, threads=args.threads)
    batch, step_s = calibrate(trainer, args.step_ms / 1e3)
    log(f"training step: batch {batch}, {step_s * 1e3:.1f} ms on {args.threads} threads")

    scratch = Path(tempfile.mkdtemp(prefix="stashpoint-steptime-", dir=args.dir or default_scratch_base()))
    trials: list[dict[str, Any]] = []
    try:
        for method in args.methods:  # first calls: staging memory touched, the writer process started
            writer = method.partition("-")[0]
            stashpoint.save(state, scratch / "warmup", writer="process" if writer == "process" else "thread")
            shutil.rmtree(scratch / "warmup")
        for regime in args.regimes:
            for _ in range(args.repeats):
                for method in args.methods:
                    trials.append(
                        trial(trainer, state, scratch / "ck", method=method, regime=regime, op_timeout=args.op_timeout)
                    )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = summarize(trials)
    print(table(summary))
    meta = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "torch": torch.__version__,
        "state_bytes": shape.state_bytes,
        "step": {"batch": batch, "width": args.width, "depth": args.depth, "threads": args.threads, "s": step_s},
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "summary": summary, "trials": trials}, indent=1))
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
