"""A run root's steps, on any storage backend: list, read metrics, delete, move aside, clean up."""

from __future__ import annotations

import functools
import logging
import operator
import time
from collections.abc import Callable, Iterator, Set
from typing import Any

from stashpoint._core.naming import (
    MANIFEST_NAME,
    REWIND_NAME,
    is_partial_of,
    parse_step_dir,
    set_aside_name,
    step_dir,
    written_by_a_save,
)
from stashpoint._core.policy import Retention, parse_metrics, steps_to_keep
from stashpoint._load.manifest import read_head
from stashpoint._storage import LocalStorage, Storage
from stashpoint.errors import CheckpointError, CorruptCheckpointError

log = logging.getLogger("stashpoint")

METRICS_KEY = "stashpoint.metrics"


def step_number(step: object) -> int:
    """``step`` as an int: any integer type (numpy's ``int64`` too), never a bool or a float."""
    try:
        n = operator.index(step)  # type: ignore[arg-type]
    except TypeError:
        n = -1
    if isinstance(step, bool) or n < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    return n


def holds_manifest(step: Storage) -> bool:
    """Whether a step directory holds its manifest (is committed). A "no" from an object store
    is asked again through a listing: one HEAD answered 404 (a lagging replica of the store, a
    proxy) must not have a committed step taken for a leftover and deleted, or passed by."""
    if step.exists(MANIFEST_NAME):
        return True
    return not isinstance(step, LocalStorage) and step.listed(MANIFEST_NAME)


def committed_steps(root: Storage, known: set[int] | None = None) -> list[int]:
    """The committed steps under a run root, oldest first.

    ``known``: the steps this caller already found committed there (updated in place), whose
    manifests are not asked for again: one listing a call instead of a request per step (a HEAD
    each on object storage, with ``keep_every`` ever more). The caller must discard a step it
    deletes; a step no longer listed is forgotten."""
    found = []
    listed = set()
    for name in root.children():
        step = parse_step_dir(name)
        if step is None:
            continue
        listed.add(step)
        if (known is not None and step in known) or holds_manifest(root.child(name)):
            found.append(step)
    if known is not None:
        known.intersection_update(listed)
        known.update(found)
    return sorted(found)


# read_metrics' answer for a step whose manifest is damaged (told apart by identity)
DAMAGED: dict[str, Any] = {}
_told: set[tuple[int, str]] = set()  # (step, kind) already warned about by this process


def read_metrics(step: Storage) -> dict[str, Any] | None:
    """The metrics a step was saved with: :data:`DAMAGED` when its manifest is damaged, None
    when it cannot be read now (permissions, the storage unreachable)."""
    try:
        return parse_metrics(read_head(step).metadata.get(METRICS_KEY, "{}"))
    except CorruptCheckpointError:
        return DAMAGED
    except (CheckpointError, OSError):  # IncompleteCheckpointError too: its manifest went meanwhile
        return None


class StepMetrics:
    """The metrics of a manager's steps, by step: those its saves were given, and those read from
    a step's manifest when the retention first asks (``keep_best`` after a restart). ``at``: a
    step's storage in the local root; ``known``: the steps the local root holds (the manager's
    set, kept up to date by it)."""

    def __init__(self, at: Callable[[int], Storage], known: Set[int]) -> None:
        self._at, self._known = at, known
        self._by_step: dict[int, dict[str, Any]] = {}
        self.said: set[str] = set()  # the kinds of keep_best metric problems warned of

    def of(self, step: int, root: Storage | None = None) -> dict[str, Any] | None:
        """``step``'s metrics, read from its manifest in ``root`` (default: the local root) the
        first time; None while unreadable (asked again next time)."""
        got = self._by_step.get(step)  # one lookup: the retention of the other tier may drop it meanwhile
        if got is None:
            got = read_metrics(self._at(step) if root is None else root.child(step_dir(step)))
            if got is None:
                return None
            self._by_step[step] = got
        return got

    def put(self, step: int, metrics: dict[str, Any]) -> None:
        self._by_step[step] = metrics

    def drop(self, step: int) -> None:
        """``step`` deleted or moved aside in the local root (its number may be saved again)."""
        self._by_step.pop(step, None)

    def forget(self, step: int) -> None:
        """``step`` deleted from the remote tier: its metrics go unless the local root holds it."""
        if step not in self._known:
            self._by_step.pop(step, None)

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._by_step))

    def __len__(self) -> int:
        return len(self._by_step)


def retained(steps: list[int], metrics_of: Callable[[int], dict[str, Any] | None], retention: Retention) -> set[int]:
    """The steps the retention rules keep, counting only steps whose manifests read whole; and
    every step whose manifest cannot be read now (it may well be whole and, with ``keep_best``,
    the best one) and every damaged one above the newest whole step (a restore's to move aside).
    Counted, a damaged or planted step numbered above the rest (its directory's name is all it
    takes) would have been "the last" and the real ones deleted. Damaged steps below the newest
    whole one go as any step the rules do not keep."""
    metrics = {s: metrics_of(s) for s in steps}
    unknown = {s for s, m in metrics.items() if m is None}
    damaged = {s for s, m in metrics.items() if m is DAMAGED}
    counted = [s for s in steps if s not in unknown and s not in damaged]
    above = {s for s in damaged if not counted or s > max(counted)}
    for kind, which in (("could not be read", unknown), ("is damaged", above)):
        new = sorted(s for s in which if (s, kind) not in _told)
        if new:
            _told.update((s, kind) for s in new)
            log.warning("stashpoint: kept step(s) %s, not counted by the retention rules: the manifest %s", new, kind)
    return set(steps_to_keep(counted, {s: metrics[s] or {} for s in counted}, retention)) | unknown | above


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


def remove_leftovers(root: Storage) -> int:
    """What crashes left in a run root (its owner's, under its lock): steps never committed.
    Returns how many step directories of them it removed."""
    found = 0
    for name in root.children():
        target = root.child(name)
        if parse_step_dir(name) is not None and not holds_manifest(target):
            found += remove_leftover(target)
    if isinstance(root, LocalStorage):  # a rewind mark a crash left half written (object stores write whole)
        for name in root.list():
            if is_partial_of(name, REWIND_NAME):
                quietly(functools.partial(root.delete, name))
    return found


def remove_leftover(target: Storage) -> bool:
    """:func:`clear_leftover`, logging why a leftover was kept or could not be removed; whether
    it was removed."""
    try:
        kept = clear_leftover(target)
    except OSError as e:
        kept = f"cleanup of {target.location} failed: {e}"
    if kept is not None:
        log.warning("stashpoint: %s", kept)
    return kept is None


def clear_leftover(target: Storage) -> str | None:
    """Remove a step directory a save that never committed left; None once done, else why it
    was kept: one that holds files no save writes (a user's ``model.pt`` in an older run's
    ``step-00000500``) is not stashpoint's to delete."""
    names = target.tree()
    if names == []:  # none there (the usual case: a new step), or a link or file in its place
        if isinstance(target, LocalStorage) and (target.root.is_symlink() or target.root.exists()):
            log.warning("stashpoint: removing %s (empty, or a file or link where a step goes)", target.location)
        target.remove_tree()
        return None
    foreign = None if names is None else [n for n in names if not written_by_a_save(n)]
    if foreign is None or foreign:
        shown = "files it could not list" if foreign is None else ", ".join(map(repr, foreign[:3]))
        return (
            f"{target.location} holds no committed checkpoint but {shown}, which stashpoint did not write: "
            "it is left as it is; move those files out of the run directory (a manager owns its step-* "
            "directories)"
        )
    log.warning("stashpoint: removing %s, left by a save that never committed", target.location)
    target.remove_tree()
    return None


def move_aside(root: Storage, step: int, why: str = "damaged") -> bool:
    """Rename a damaged (or rewound) step ``step-XXXXXXXX.damaged-<time>[-n]``: kept for
    inspection, never listed. Returns whether it moved (a failure is logged)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        taken = set(root.children())
        name = next((n for i in range(10_000) if (n := set_aside_name(step, stamp, why, i)) not in taken), None)
        if name is None:
            raise FileExistsError(f"every name for step {step} set aside at {stamp} is taken")
        moved = root.child(step_dir(step)).move(name)
        log.warning(
            "stashpoint: moved the %s step %d aside to %s%s",
            why,
            step,
            moved.location,
            f" (the error above says why; a step that lacks a file, of a partial copy say, loads again once the "
            f"file is back and the directory renamed {step_dir(step)})"
            if why == "damaged"
            else "",
        )
        return True
    except OSError as e:
        log.warning("stashpoint: could not move the %s step %d aside: %s", why, step, e)
        return False


def quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except OSError as e:
        log.warning("stashpoint: cleanup failed: %s", e)
