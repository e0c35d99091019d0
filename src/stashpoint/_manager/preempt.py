"""Preemption: a signal (SIGTERM) asks the job to stop; the manager saves and exits at a safe point.

A signal handler only notes the signal: a collective save cannot start inside it (the training
thread may be inside its own all-reduce). The next ``maybe_save`` of every rank is the safe
point. The ranks agree there whether any of them was signalled (a launcher may signal one node
only), over a gloo group of stashpoint's own, never the training's.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from types import FrameType
from typing import Any, NoReturn

log = logging.getLogger("stashpoint")


class Preemption:
    """Handlers for ``signals`` (main thread only, from :meth:`install`); :meth:`agreed` says
    whether any rank got one. ``close`` puts the previous handlers back."""

    def __init__(self, deadline_s: float, signals: Sequence[int], world: int) -> None:
        if not deadline_s > 0:
            raise ValueError(f"preemption_deadline must be a positive number of seconds, got {deadline_s!r}")
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "preemption handling installs signal handlers, which Python allows only in the main thread: "
                "create this CheckpointManager there"
            )
        self.deadline_s = float(deadline_s)
        self.signum: int | None = None
        self.since: float | None = None
        self._group: Any = None
        if world > 1:
            import torch.distributed as dist

            # every rank creates its manager at the same point, so every rank creates this group;
            # ranks may reach maybe_save minutes apart (one rank evaluating): torch's own default
            self._group = dist.new_group(backend="gloo", timeout=timedelta(minutes=30))
        self._signals = tuple(signals)
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Take over the signals (last, once the manager is set up: a manager that failed to open
        must leave SIGTERM's default action alone)."""
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum, self.since = signum, time.monotonic()
            # logging from a handler may deadlock on the logging lock: say it at the safe point

    def agreed(self) -> int | None:
        """The signal any rank got (this rank's, or SIGTERM for another's), or None: a collective
        over every rank of the manager when there are several."""
        if self._group is None:
            return self.signum
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self.signum or 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        got = int(flag.item())
        if got and self.signum is None:
            self.signum, self.since = got, time.monotonic()
        return got or None

    def left(self) -> float:
        """Seconds left of the deadline, counted from when this rank learnt of the signal."""
        since = self.since if self.since is not None else time.monotonic()
        return self.deadline_s - (time.monotonic() - since)

    def close(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


def stop(manager: Any, preemption: Preemption, signum: int, step: int, save: Any) -> NoReturn:
    """Finish the save in flight, save ``step`` unless it is saved already, all within the
    deadline, then raise SystemExit (128 + the signal), as the signal's default action would
    end the process. The last committed step stays whole whatever happens in between."""
    name = signal.Signals(signum).name
    log.warning(
        "stashpoint: %s received; saving step %d within %.0f s, then exiting", name, step, max(0.0, preemption.left())
    )
    t0 = time.monotonic()
    outcome = f"step {step} committed"
    try:
        for handle, after in manager.in_flight():
            handle.wait(max(0.0, preemption.left()))
            after.result(max(0.0, preemption.left()))
        if step not in manager.steps():  # the emergency save
            save(timeout=max(1.0, preemption.left())).wait(max(0.0, preemption.left()))
    except Exception as e:  # exiting anyway: the newest committed step is what a restart gets
        outcome = f"no new step committed ({type(e).__name__}: {e}); a restart loads step {manager.latest_step()}"
    log.warning("stashpoint: preempted by %s: %s in %.1f s; exiting", name, outcome, time.monotonic() - t0)
    raise SystemExit(128 + signum)
