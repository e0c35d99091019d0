"""A manager's retention: the steps of its root its rules do not keep, deleted on the
manager's deletion thread once a save committed, an upload ended or an ``on_save`` call
returned; the steps still awaited (an upload, a callback, the newest a node loss survives)
are kept meanwhile."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from stashpoint import _runtime
from stashpoint._core.naming import RECOVERABLE_NAME, step_dir
from stashpoint._manager.steps import delete_step, retained
from stashpoint._storage import Storage

if TYPE_CHECKING:
    from stashpoint._manager.manager import CheckpointManager

log = logging.getLogger("stashpoint")


def upload_ended(mgr: CheckpointManager) -> None:
    """An upload ended: local steps it protected may go now."""
    with mgr._lock:
        if mgr._owner and not mgr._closed:
            retain_later(mgr)


def retain_later(mgr: CheckpointManager) -> None:
    """Apply the retention rules on the manager's thread (called under ``mgr._lock``). At
    interpreter exit, a save still ending in a manager never closed finds that thread gone
    (the interpreter stops its pools first): the rules are applied here and now."""
    mgr._deletions = [f for f in mgr._deletions if not f.done()]  # they never fail: nothing to keep
    mgr._deletions.append(_runtime.submit_or_run(mgr._deleter, apply_retention, mgr))


def apply_retention(mgr: CheckpointManager) -> None:
    """Delete the steps of ``mgr``'s root its retention rules do not keep (on the manager's
    deletion thread); a failure is logged, never raised."""
    try:
        steps = mgr.steps()
        keep = retained(steps, mgr._metrics.of, mgr.retention) | mgr._awaiting.steps()
        if mgr._tier is not None:
            keep |= mgr._tier.protected()  # not uploaded yet (pending, or failed: tried again)
        if mgr._nodes is not None and mgr._replicas > 0:
            keep |= newest_recoverable(mgr.storage, steps)
        for step in steps:
            if step not in keep:
                mgr._known.discard(step)
                delete_step(mgr.storage, step)
                mgr._metrics.drop(step)
    except Exception:
        log.exception("stashpoint: applying the retention rules to %s failed", mgr.storage.location)


def newest_recoverable(root: Storage, steps: list[int]) -> set[int]:
    """The newest of ``steps`` that a node lost now could be restored from (its files copied to
    other nodes, ``recoverable.json``), kept while the newer ones' copies failed: the retention
    would otherwise delete the last step that survives a node loss."""
    for step in reversed(steps):
        try:
            if root.child(step_dir(step)).exists(RECOVERABLE_NAME):
                return {step}
        except OSError:
            continue
    return set()
