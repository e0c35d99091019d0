"""A run root's steps, on any storage backend: list, read metrics, delete, move aside, clean up."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from stashpoint._core.naming import MANIFEST_NAME, parse_step_dir, set_aside_name, step_dir
from stashpoint._core.policy import Retention, parse_metrics, steps_to_keep
from stashpoint._load.manifest import read_head
from stashpoint._storage import Storage
from stashpoint.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError

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


def read_metrics(step: Storage) -> dict[str, Any] | None:
    """The metrics a step was saved with: {} when its manifest is damaged, None when it cannot
    be read now (permissions, the storage unreachable)."""
    try:
        return parse_metrics(read_head(step).metadata.get(METRICS_KEY, "{}"))
    except (CorruptCheckpointError, IncompleteCheckpointError):
        return {}
    except (CheckpointError, OSError):
        return None


def retained(steps: list[int], metrics_of: Callable[[int], dict[str, Any] | None], retention: Retention) -> set[int]:
    """The steps the retention rules keep, and every step whose metrics cannot be read now: its
    manifest may well be whole, and with ``keep_best`` it may be the best one."""
    metrics = {s: metrics_of(s) for s in steps}
    unknown = {s for s, m in metrics.items() if m is None}
    if unknown:
        log.warning("stashpoint: kept step(s) %s: their manifests could not be read for retention", sorted(unknown))
    return set(steps_to_keep(steps, {s: m or {} for s, m in metrics.items()}, retention)) | unknown


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
