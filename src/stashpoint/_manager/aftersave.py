"""What a manager does after a save failed: whether its step holds a manifest, and what a save
that found no room needs."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from stashpoint._manager.steps import holds_manifest
from stashpoint._storage import LocalStorage, Storage
from stashpoint.errors import CheckpointError

if TYPE_CHECKING:
    from stashpoint._manager.manager import CheckpointManager

log = logging.getLogger("stashpoint")


def holds_manifest_or_unknown(at: Storage) -> bool:
    """Whether a failed save's step holds a manifest; where the storage cannot say (a server
    down), True: its files are kept for the next manager's clean-up, not guessed away."""
    try:
        return holds_manifest(at)
    except (OSError, CheckpointError) as e:
        log.warning("stashpoint: left %s as it is: could not tell whether it holds a checkpoint (%s)", at.location, e)
        return True


def out_of_space(error: BaseException) -> bool:
    return "No space left on device" in str(error) or "Disk quota exceeded" in str(error)


def say_room(mgr: CheckpointManager, step: int) -> None:
    """A save that found no room: say what the run needs, as the steps it keeps plus the one
    being written (the oldest goes only once the new one committed)."""
    import shutil

    kept, last = mgr.retention.bound(), (mgr.history[-1] if mgr.history else None)
    if kept is None or last is None or not isinstance(mgr.storage, LocalStorage) or not last.bytes_written:
        return
    try:
        free = shutil.disk_usage(mgr.storage.root).free
    except OSError:
        return
    log.warning(
        "stashpoint: step %d found no room in %s: this run keeps %d step(s) and writes the next beside them before "
        "the oldest goes, so it needs room for %d steps of about %.3g GB (%.3g GB free now): free space there, "
        "lower keep_last, or choose a larger disk",
        step,
        mgr.storage.root,
        kept,
        kept + 1,
        last.bytes_written / 1e9,
        free / 1e9,
    )
