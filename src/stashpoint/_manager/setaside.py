"""A save whose step goes back below the run's highest: the steps of the run it abandons
moved aside (``step-N.rewound-<time>``) in both tiers, before the save begins."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from stashpoint._core.naming import MANIFEST_NAME, step_dir
from stashpoint._manager.steps import committed_steps, move_aside
from stashpoint._storage import Storage
from stashpoint.errors import CheckpointError

if TYPE_CHECKING:
    from stashpoint._manager.manager import CheckpointManager

log = logging.getLogger("stashpoint")


def set_aside_newer(mgr: CheckpointManager, step: int) -> tuple[bool, str | None]:
    """Before a save whose step goes back below the run's highest (after ``restore(step=K)``
    below the newest step, or a new run in an old root saving low steps): move the steps of the
    run that was abandoned aside (``step-N.rewound-<time>``), in both tiers. Retention ranks
    steps by number and a restart takes the highest: left in place they would delete every step
    saved after the rewind and be resumed in its stead. After a restore of K, every step above
    K goes (the save may re-use their numbers); otherwise every step above the one saved, and a
    save of a step already there is refused (by the caller) with nothing moved.

    Decided alike on every rank where it raises (the saves in flight are the same everywhere);
    only the roots' owners list and move. Moving a remote step aside on object storage copies
    it, server-side, within this call; where the remote tier cannot be listed now, the step's
    upload moves them (``mgr._remote_rewind``, written down in the local root until one has:
    ``_manager/rewindmark``). Returns whether this is the first save after a
    restore of a lower step, alike on every rank (a step already there is then the owners' to
    move, not a reason to refuse the save), and, on an owner, why the save must be refused (a
    step that could not be moved aside), for the caller to fail the save on every rank."""
    resumed, mgr._resumed_at = mgr._resumed_at, None
    after_restore = resumed is not None and resumed < step
    if after_restore and mgr._remote_unseen and mgr._tier is not None and mgr.rank == 0:
        # the restore could not see the remote tier: its steps above the one restored are the
        # branch this run leaves, whatever the local tier holds; its uploads move them aside
        mgr._remote_rewind = resumed
    with mgr._lock:
        busy = sorted(h.step for h, a in mgr._handles if h.step is not None and h.step > step and not a.done())
    if busy:
        raise CheckpointError(
            f"step {step} is below step {busy[-1]}, which is still being saved; wait for it (mgr.wait()) before "
            "saving a lower step"
        )
    local = mgr._owner
    remote = mgr._tier is not None and mgr.rank == 0 and not mgr._remote_unseen
    roots = ([mgr.storage] if local else []) + ([mgr._tier.remote] if remote and mgr._tier is not None else [])
    if not roots:  # the others' steps are the owners' to move
        return after_restore, None
    if mgr._top is None:  # listed once; after that only a save below the highest step lists again
        # damaged and unreadable steps count: one above the save would otherwise be left in its way
        mgr._top = max((s for root in roots for s in (_listed(mgr, root, committed_steps) or [])), default=-1)
    top, mgr._top = mgr._top, max(mgr._top, step)
    if step > top:  # the step numbers go on: nothing to set aside, even after looking at an old step
        return after_restore, None
    above = resumed if resumed is not None and after_restore else step
    if remote and mgr._tier is not None:
        # uploads end first: one ending after the listing below would leave its step, of the
        # run abandoned, in the remote tier for a fresh node to resume
        mgr._tier.settle()
    listed = {root: _steps(mgr, root) for root in roots}
    doomed = {root: [s for s in steps if s > above] for root, steps in listed.items() if steps is not None}
    if local and mgr._at(step).exists(MANIFEST_NAME) and step not in doomed[mgr.storage]:
        return after_restore, None  # a save of a step already there: refused by the caller, nothing moved
    if remote and any(steps is None for steps in listed.values()):
        mgr._remote_rewind = above  # moved by this step's own upload, before it copies anything
    for root, newer in doomed.items():
        if newer:
            log.warning(
                "stashpoint: step %d goes back below the steps %s of %s (a rewind, or a new run in an old root): "
                "they are moved aside as step-N.rewound-<time>, so that neither the retention nor a restart takes "
                "them for this run's newest",
                step,
                ", ".join(map(str, newer[:8])) + (", ..." if len(newer) > 8 else ""),
                root.location,
            )
        for s in newer:
            mgr._known.discard(s)
            mgr._metrics.drop(s)  # the number may be saved again, with the new run's metrics
            if not move_aside(root, s, "rewound"):  # kept: it may be saved over, never deleted
                mgr._top, mgr._resumed_at, mgr._remote_rewind = None, resumed, None  # the next save decides anew
                return True, (
                    f"step {s} of {root.location}, of the run abandoned by going back to step {above}, could not be "
                    "moved aside (the warning above says why); nothing was saved. Fix the cause and save again, or "
                    f"move {step_dir(s)} away yourself"
                )
    mgr._top = max(step, above)
    return after_restore, None


def _steps(mgr: CheckpointManager, root: Storage) -> list[int] | None:
    """Every committed step of ``root``, damaged ones too (a damaged step above a rewind would
    refuse the new run's save of its number); None for a remote tier that cannot be listed now."""
    return mgr.steps() if root is mgr.storage else _listed(mgr, root, committed_steps)


def _listed(mgr: CheckpointManager, root: Storage, lister: Callable[[Storage], list[int]]) -> list[int] | None:
    try:
        return lister(root)
    except (OSError, CheckpointError) as e:
        if root is mgr.storage:
            raise
        log.warning("stashpoint: listing %s failed (%s: %s)", root.location, type(e).__name__, e)
        return None
