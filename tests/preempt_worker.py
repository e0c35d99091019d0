"""A training loop under a CheckpointManager with preemption handling, for tests/test_preempt.py.

    python preempt_worker.py DIR STEPS [--every N] [--deadline S] [--mb M] [--stuck-at N] [--after S] [--skip N]
    (one process, or under torchrun)

Resumes from DIR/ckpt, then trains a small model one step at a time (deterministic data, 0.2 s
per step), writing ``DIR/progress-<rank>`` (the step just trained) before each ``maybe_save``.
Prints ``RESUMED <step>`` after the restore and writes ``DIR/done-<rank>`` at a normal end.
``--mb``: M MiB more state (a save that outlasts a short deadline); ``--stuck-at``: after step
N's maybe_save, 60 s of work that never reaches the next (an evaluation, a hung collective);
``--after``: S seconds of work after the last step, inside the manager's ``with``; ``--skip``:
rank 1 skips the maybe_save of step N (``RESULT {"error": ...}`` on a CheckpointError);
``--remote``: a remote tier there, each step's upload made ``SLOW_UPLOAD`` seconds longer.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import stashpoint


def slow_uploads(seconds: float) -> None:
    from stashpoint._manager import uploader

    copy, slowed = uploader.copy_file, set()

    def copying(src, dst, up):  # type: ignore[no-untyped-def]
        if dst.location not in slowed:  # once per step
            slowed.add(dst.location)
            time.sleep(seconds)
        return copy(src, dst, up)

    uploader.copy_file = copying  # type: ignore[assignment]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("steps", type=int)
    ap.add_argument("--every", type=int, default=1000)
    ap.add_argument("--deadline", type=float, default=20.0)
    ap.add_argument("--mb", type=int, default=0)
    ap.add_argument("--stuck-at", type=int, default=-1)
    ap.add_argument("--after", type=float, default=0.0)
    ap.add_argument("--skip", type=int, default=-1)
    ap.add_argument("--remote", default=None)
    args = ap.parse_args()
    if os.environ.get("SLOW_UPLOAD"):
        slow_uploads(float(os.environ["SLOW_UPLOAD"]))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = Path(args.dir)
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": optim, "rng": stashpoint.RNGState(), "extra": torch.ones(args.mb << 18)}
    with stashpoint.CheckpointManager(
        out / "ckpt", every_steps=args.every, preemption_deadline=args.deadline, remote_root=args.remote
    ) as mgr:
        start = (mgr.restore(state) or 0) + 1
        print(f"RESUMED {start - 1}", flush=True)
        for step in range(start, args.steps + 1):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))
            model(x).pow(2).mean().backward()
            optim.step()
            optim.zero_grad()
            (out / f"progress-{rank}").write_text(str(step))
            time.sleep(0.2)
            if step == args.skip and rank == 1:
                continue
            try:
                mgr.maybe_save(step, state)
            except stashpoint.CheckpointError as e:
                print("RESULT " + json.dumps({"error": str(e)}), flush=True)
                os._exit(1)
            if step == args.stuck_at:
                time.sleep(60)
        time.sleep(args.after)
    (out / f"done-{rank}").write_text("ok")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
