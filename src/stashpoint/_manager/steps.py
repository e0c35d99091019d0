"""A run root's steps, on any storage backend: list, read metrics, delete, move aside, clean up."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from stashpoint._core.naming import MANIFEST_NAME, parse_step_dir, set_aside_name, step_dir
from stashpoint._core.policy import parse_metrics
from stashpoint._load.manifest import read_head
from stashpoint._storage import Storage
from stashpoint.errors import CheckpointError

log = logging.getLogger("stashpoint")

METRICS_KEY = "stashpoint.metrics"


def committed_steps(root: Storage) -> list[int]:
    """The committed steps under a run root, oldest first."""
    found = []
    for name in root.children():
        step = parse_step_dir(name)
        if step is not None and root.child(name).exists(MANIFEST_NAME):
            found.append(step)
    return sorted(found)


def read_metrics(step: Storage) -> dict[str, float]:
    """The metrics a step was saved with ({} when unreadable)."""
    try:
        return parse_metrics(read_head(step).metadata.get(METRICS_KEY, "{}"))
    except (CheckpointError, OSError):
        return {}


def delete_step(root: Storage, step: int) -> None:
    """Uncommit first (the manifest goes), then remove the rest: a crash leaves a leftover."""
    target = root.child(step_dir(step))
    try:
        target.delete(MANIFEST_NAME)
        target.sync()
        target.remove_tree()
        log.info("stashpoint: removed step %d from %s (retention)", step, root.location)
    except OSError as e:
        log.warning("stashpoint: could not remove %s: %s", target.location, e)


def remove_leftovers(root: Storage) -> None:
    for name in root.children():
        step = parse_step_dir(name)
        target = root.child(name)
        if step is not None and not target.exists(MANIFEST_NAME):
            log.warning("stashpoint: removing %s, left by a save that never committed", target.location)
            quietly(target.remove_tree)


def move_aside(root: Storage, step: int) -> None:
    """Rename a damaged step ``step-XXXXXXXX.damaged-<time>``: kept for inspection, never listed."""
    name = set_aside_name(step, time.strftime("%Y%m%d-%H%M%S"))
    try:
        moved = root.child(step_dir(step)).move(name)
        log.warning("stashpoint: moved the damaged step %d aside to %s", step, moved.location)
    except OSError as e:
        log.warning("stashpoint: could not move the damaged step %d aside: %s", step, e)


def quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except OSError as e:
        log.warning("stashpoint: cleanup failed: %s", e)
