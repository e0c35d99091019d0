"""The emergency stop at a safe point once a preemption signal came: finish the save in flight,
save the step, then end the process as the signal would have, all within the deadline."""

from __future__ import annotations

import logging
import time
from typing import Any, NoReturn

from stashpoint._manager.preempt import Preemption, exit_now, signal_name

log = logging.getLogger("stashpoint")


def stop(manager: Any, preemption: Preemption, signum: int, step: int, save: Any) -> NoReturn:
    """Finish the save in flight, save ``step`` unless it is saved already, all within the
    deadline, then raise SystemExit (128 + the signal), as the signal's default action would
    end the process. If the deadline passes first, exit at once (the save is abandoned; the
    last committed step stays whole, whatever happens in between)."""
    name = signal_name(signum)
    who = "" if preemption.mine else " by another rank"
    log.warning(
        "stashpoint: %s received%s; saving step %d within %.3g s, then exiting",
        name,
        who,
        step,
        max(0.0, preemption.left()),
    )
    t0 = time.monotonic()
    preemption.stopping = True
    try:
        for handle, after in manager.in_flight():
            try:
                handle.wait(max(0.0, preemption.left()))
                after.result(max(0.0, preemption.left()))
            except Exception as e:  # an earlier step's failure: this step may still be saved
                if preemption.left() <= 0:
                    raise
                log.warning(
                    "stashpoint: the save in flight failed (%s: %s); saving step %d anyway", type(e).__name__, e, step
                )
        if step not in manager.steps():  # the emergency save
            save(timeout=max(1.0, preemption.left())).wait(max(0.0, preemption.left()))
        if manager._tier is not None:  # committed: its upload next, the older ones not begun wait
            manager._tier.uploader.superseded_below = step
    except Exception as e:  # exiting anyway: the newest committed step is what a restart gets
        if _committed(manager, step):  # committed; what failed or ran out of time came after the commit
            preemption.handled = True
            log.warning(
                "stashpoint: preempted by %s: step %d committed in %.1f s (then %s: %s); exiting",
                name,
                step,
                time.monotonic() - t0,
                type(e).__name__,
                e,
            )
            raise SystemExit(128 + signum) from None
        if preemption.left() > 0:  # it failed in time (no room, ...): the program's clean-up may run
            preemption.handled = True
            log.warning(
                "stashpoint: preempted by %s: no new step committed (%s: %s); a restart loads %s; exiting",
                name,
                type(e).__name__,
                e,
                _what_a_restart_loads(manager),
            )
            raise SystemExit(128 + signum) from None
        exit_now(
            signum,
            f"no new step committed in {time.monotonic() - t0:.1f} s ({type(e).__name__}: {e}); a "
            f"restart loads {_what_a_restart_loads(manager)}",
        )
    preemption.handled = True  # the watchdog stands down: the program's own clean-up may take its time
    log.warning("stashpoint: preempted by %s: step %d committed in %.1f s; exiting", name, step, time.monotonic() - t0)
    raise SystemExit(128 + signum)


def _committed(manager: Any, step: int) -> bool:
    """Whether ``step`` is committed in the manager's root (its copies to other nodes, or its
    bookkeeping, may still be running or have failed)."""
    try:
        return step in manager.steps()
    except Exception:  # the root cannot be listed now: not known to be committed
        return False


def _what_a_restart_loads(manager: Any) -> str:
    try:
        latest = manager.latest_step()
    except Exception:
        latest = None
    return "nothing (no step is committed)" if latest is None else f"step {latest}"
