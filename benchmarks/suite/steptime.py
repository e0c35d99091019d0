"""The training-loop experiment: step times while checkpointing every K steps, against none.

A small MLP is trained in the same process as the big state (``torch`` threads as the worker
has them: 2 on one rank, 1 per rank on two ranks, whose gradients are all-reduced on a group of
the training's own). The MLP and its AdamW join the checkpointed state, so a step is a real
optimizer step on checkpointed tensors: overlap modes and staging locks are exercised as a user
would. The batch is calibrated once per run (:func:`calibrate_batch`) so that a step takes the
time asked for, and every method trains the same steps.

After one unmeasured save (a process's first save allocates buffers and starts writer processes),
``baseline`` undisturbed steps, then ``checkpoints`` x ``every`` steps with a save started
every ``every`` steps (a save still in flight is waited for first, as every library does). Each
step's start and duration are recorded, and each save's call, blocking time and completion (seen
at the end of a step), for the timeline plot. The checkpoints are kept until the end (cold page
cache, as in a real run).
"""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path
from typing import Any

from .common import fsync_tree, log, median
from .savers import Pending, Saver

SETTLE_S = 2.0  # seconds between the warm-up save and the baseline


class Trainer:
    """An MLP of ``depth`` square layers and its AdamW; :meth:`step` is one training step."""

    def __init__(self, width: int, depth: int, seed: int, batch: int, group: Any = None) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        self.model = torch.nn.Sequential(*layers)
        with torch.no_grad():
            for p in self.model.parameters():
                p.normal_(0.0, 0.02, generator=g)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.width, self.group, self.batch = width, group, batch
        self._gen = torch.Generator().manual_seed(seed + 1)

    def step(self, guard: Any) -> None:
        import torch
        import torch.distributed as dist

        x = torch.randn(self.batch, self.width, generator=self._gen)
        loss = self.model(x).pow(2).mean()
        loss.backward()
        if self.group is not None:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.group)
            off = 0
            for gr in grads:
                gr.copy_(flat[off : off + gr.numel()].view_as(gr))
                off += gr.numel()
        with guard():
            self.optim.step()
        self.optim.zero_grad(set_to_none=True)


def calibrate_batch(width: int, step_ms: float, threads: int) -> tuple[int, float]:
    """The batch for which one :class:`Trainer` step takes about ``step_ms`` on ``threads`` threads,
    and the ms per step measured with it. Done once per run, so every method trains the same steps.

    The fastest of a few steps counts (the machine may be shared); a few rounds converge, since
    the time is not proportional to the batch.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        trainer = Trainer(width, depth=4, seed=0, batch=32)
        for _ in range(2):
            trainer.step(contextlib.nullcontext)
        per = 1e-3
        for _ in range(8):
            probe = []
            for _ in range(5):
                t0 = time.perf_counter()
                trainer.step(contextlib.nullcontext)
                probe.append(time.perf_counter() - t0)
            per = min(probe)
            factor = min(8.0, max(1 / 8, step_ms / 1e3 / per))  # a descheduled probe must not wreck it
            if 0.93 < factor < 1.07:
                break
            trainer.batch = int(min(16384, max(4, round(trainer.batch * factor))))
        return trainer.batch, per * 1e3
    finally:
        torch.set_num_threads(before)


def run(
    saver_factory: Any,
    state: dict[str, Any],
    root: Path,
    *,
    every: int,
    checkpoints: int,
    baseline: int,
    batch: int,
    width: int,
    seed: int,
    group: Any = None,
    barrier: Any = None,
) -> dict[str, Any]:
    """Run the experiment; ``saver_factory(state)`` makes the saver once the MLP joined the state."""
    trainer = Trainer(width, depth=4, seed=seed, batch=batch, group=group)
    state["mlp"], state["mlp_optim"] = trainer.model, trainer.optim
    for _ in range(3):
        trainer.step(contextlib.nullcontext)
    saver: Saver = saver_factory(state)
    warm = root / "loop-warmup"  # the first save of a process sets things up (buffers, writer processes)
    saver.start(warm).wait()
    if barrier is not None:
        barrier()
    if warm.exists():
        fsync_tree(warm)  # no writeback of it left to disturb the baseline
    if barrier is not None:
        barrier()  # no rank removes it while another still fsyncs it
    shutil.rmtree(warm, ignore_errors=True)
    time.sleep(SETTLE_S)  # what a library does after reporting done (closing, unmapping) ends first
    steps: list[tuple[float, float, bool]] = []  # (start since t_origin, seconds, a save was called in it)
    saves: list[dict[str, Any]] = []
    paths: list[Path] = []
    if barrier is not None:
        barrier()
    origin = time.perf_counter()
    try:
        for _ in range(baseline):
            t0 = time.perf_counter()
            trainer.step(contextlib.nullcontext)
            steps.append((t0 - origin, time.perf_counter() - t0, False))
        pending: Pending | None = None
        current: dict[str, Any] | None = None
        for i in range(checkpoints * every):
            t0 = time.perf_counter()
            called = False
            if i % every == 0:
                if pending is not None and current is not None:
                    _finish(pending, current, origin)
                path = root / f"loop-{i // every}"
                paths.append(path)
                t_call = time.perf_counter()
                pending = saver.start(path)
                t_ret = time.perf_counter()
                current = {"step": baseline + i, "call_at": t_call - origin, "blocking_s": t_ret - t_call}
                saves.append(current)
                called = True
            guard = pending.guard if pending is not None else contextlib.nullcontext
            trainer.step(guard)
            t1 = time.perf_counter()
            steps.append((t0 - origin, t1 - t0, called))
            if current is not None and "done_at" not in current and pending is not None and pending.done():
                current["done_at"] = t1 - origin
        if pending is not None and current is not None:
            _finish(pending, current, origin)
    finally:
        saver.close()
        del state["mlp"], state["mlp_optim"]
        if barrier is not None:
            barrier()
        for p in paths:  # every rank: whichever comes first removes a path
            shutil.rmtree(p, ignore_errors=True)
    return {
        "steps": [{"t": t, "s": s, "save": c} for t, s, c in steps],
        "saves": saves,
        "baseline_steps": baseline,
        "every": every,
        "batch": trainer.batch,
        "width": width,
        **metrics(steps, saves, baseline),
    }


def _finish(pending: Pending, rec: dict[str, Any], origin: float) -> None:
    pending.wait()
    rec.setdefault("done_at", time.perf_counter() - origin)


def metrics(steps: list[tuple[float, float, bool]], saves: list[dict[str, Any]], baseline: int) -> dict[str, Any]:
    """Undisturbed step time, the ratio while a persist runs, the whole loop's ratio, time lost.

    Undisturbed steps: the baseline's, and those of the loop during which no save was called or in
    flight (a median over both, so that a burst of other work on the machine during the baseline
    does not set the reference). Each ratio and the time lost are against their median.
    """
    loop = steps[baseline:]
    during: list[float] = []
    quiet = [s for _, s, _ in steps[:baseline]]
    for t, s, called in loop:
        if called:
            continue
        busy = any(sv["call_at"] <= t < sv.get("done_at", float("inf")) for sv in saves)
        (during if busy else quiet).append(s)
    base = median(quiet) or float("nan")
    total = sum(s for _, s, _ in loop)
    out = {
        "base_step_ms": base * 1e3,
        "undisturbed_steps": len(quiet),
        "during_persist_steps": len(during),
        "during_persist_ratio": (median(during) or float("nan")) / base if during else None,
        "loop_ratio": total / len(loop) / base if loop else None,
        "lost_per_checkpoint_s": (total - len(loop) * base) / len(saves) if saves else None,
        "max_step_s": max((s for _, s, _ in loop), default=None),
    }
    log(
        f"steps: undisturbed {out['base_step_ms']:.1f} ms; during persist x{out['during_persist_ratio'] or 0:.2f} "
        f"({len(during)} steps); whole loop x{out['loop_ratio'] or 0:.2f}; lost "
        f"{out['lost_per_checkpoint_s'] or 0:.2f} s per checkpoint",
        "steps",
    )
    return out
