"""Which copy of which step a restore reads, agreed on by every rank."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stashpoint import _runtime
from stashpoint._load.loader import PARTLY_LOADED, load
from stashpoint._load.manifest import remembering
from stashpoint._manager.rewindmark import live, pending_rewind
from stashpoint._manager.tiers import restore_order
from stashpoint._storage import LocalStorage, Storage
from stashpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)

log = logging.getLogger("stashpoint")


@dataclass(frozen=True)
class RestoreReport:
    """What the last :meth:`CheckpointManager.restore` did on this rank (its telemetry).

    Attributes:
        step: the step loaded; None when there was no checkpoint.
        tier: where it was loaded from: ``"local"`` (the local root; with ``node_local``, this
            node's directory once what it lacked was fetched onto it) or ``"remote"``.
        order: the fall-back order, newest step first: the ``(step, tier)`` copies the restore
            would try, one after another, until one loads.
        passed_by: the copies tried first and found unusable, each ``(step, tier, why)``.
        fetched: with ``node_local``, the bytes fetched onto this rank's node before loading,
            by source: ``"peers"`` (other nodes' directories) and ``"remote"`` (the remote
            tier, for what no node held). Counted on the rank that fetches for its node (its
            ``LOCAL_RANK`` 0); empty on the others.
        fetched_into: where those bytes landed, on that rank: ``"memory"`` (shared memory on
            the node, ``/dev/shm``, read from there by the load and copied to the node's
            directory after it, in the background), ``"disk"`` (the node's directory), or
            ``""`` (nothing fetched; another rank).
        seconds: the whole restore on this rank, from listing the steps to the end of the load.
    """

    step: int | None
    tier: str | None
    order: tuple[tuple[int, str], ...]
    passed_by: tuple[tuple[int, str, str], ...]
    fetched: dict[str, int] = field(default_factory=dict)
    fetched_into: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class StepsSeen:
    """What one rank found: its local steps, rank 0's remote steps, or why it could not list."""

    error: str | None
    local: tuple[int, ...] = ()
    remote: tuple[int, ...] | None = ()  # None: the remote tier could not be listed


def reachable(remote_steps: Callable[[], list[int]]) -> list[int] | None:
    """The remote tier's steps, or None while it cannot be listed (the local copies are tried)."""
    try:
        return remote_steps()
    except (OSError, CheckpointError) as e:
        log.warning("stashpoint: listing the remote tier failed (%s: %s); trying the local tier", type(e).__name__, e)
        return None


def unseen_remote(remote: str) -> CheckpointError:
    """Why a restore that found no local step cannot say there is none to restore."""
    return CheckpointError(
        f"the remote tier {remote} cannot be listed now and the local tier holds no step to restore: whether a "
        "checkpoint exists cannot be told. Restore again once it can be reached (starting over now could later "
        "hide the remote steps)"
    )


def agreed_restore_order(
    local_steps: Callable[[], list[int]],
    remote_steps: Callable[[], list[int]],
    rank: int,
    step: int | None,
    options: dict[str, Any],
) -> tuple[list[tuple[int, str]], bool]:
    """The (step, tier) candidates every rank tries in the same order: a local copy only where
    every rank has it; the remote listing is rank 0's; an error on any rank is everybody's. And
    whether rank 0 could not list the remote tier."""
    from stashpoint._dist import group as _dist
    from stashpoint._save import engine as _save

    try:
        remote = reachable(remote_steps) if rank == 0 else []
        mine = StepsSeen(None, tuple(local_steps()), None if remote is None else tuple(remote))
    except Exception as e:
        mine = StepsSeen(f"rank {rank}: {type(e).__name__}: {e}")
    _save.wait_all()
    ctx = _dist.context(options.get("process_group"), options.get("timeout"))
    if ctx is None:
        if mine.error:
            raise CheckpointError(f"listing the checkpoints failed: {mine.error}")
        return restore_order(list(mine.local), list(mine.remote or ()), step), mine.remote is None
    seen: list[StepsSeen] | None = ctx.gather("restore: the steps each rank has", mine)  # on rank 0 only
    answer: tuple[Any, ...] | None = None
    if seen is not None:
        errors = [s.error for s in seen if s.error]
        if errors:
            answer = ("error", "; ".join(errors[:16])[:4000])
        else:
            everywhere = sorted(set.intersection(*(set(s.local) for s in seen)))
            answer = ("ok", restore_order(everywhere, list(seen[0].remote or ()), step), seen[0].remote is None)
    answer = ctx.broadcast("restore: the order", answer)
    assert answer is not None
    if answer[0] == "error":
        raise CheckpointError("listing the checkpoints to restore failed: " + answer[1])
    return list(answer[1]), bool(answer[2])


def try_in_order(
    order: list[tuple[int, str]], step: int | None, where: Callable[[int, str], Any], load_one: Callable[[Any], None]
) -> tuple[int, str, list[tuple[int, str, str]]] | None:
    """Load the first usable (step, tier) of ``order``; return it with the damaged ones tried
    before it (and why), or None when ``order`` is empty. A damaged copy is logged and the next
    one tried; with ``step`` given, the copies of that step are all there is, and their errors
    are raised."""
    damaged: list[tuple[int, str, str]] = []
    errors: list[CheckpointError] = []
    tiers: list[str] = []  # of each error's copy
    for candidate, tier in order:
        try:
            _load_remote_twice(load_one, where, candidate, tier)
        except (CorruptCheckpointError, IncompleteCheckpointError, CheckpointNotFoundError) as e:
            if step is not None and (candidate, tier) == order[-1] and not errors:
                raise
            log.error("stashpoint: the %s copy of step %d is unusable (%s); trying another", tier, candidate, _told(e))
            # its frames' locals go: the load's plan holds tensors made for it (a fresh
            # optimizer's state), which the next copy's plan would make again beside them
            _runtime.drop_locals(e)
            errors.append(e)
            tiers.append(tier)
            if not isinstance(e, CheckpointNotFoundError):  # gone as it was read: passed by, not set aside
                damaged.append((candidate, tier, str(e)[:2000]))
            continue
        return candidate, tier, damaged
    if len(errors) > 1 and step is not None:  # both copies of the step asked for
        copies = "\n".join(f"- the {t} copy: {e}" for t, e in zip(tiers, errors, strict=True))
        gone = all(isinstance(e, CheckpointNotFoundError) for e in errors)
        raise (CheckpointNotFoundError if gone else CorruptCheckpointError)(
            f"every copy of step {step} is unusable:\n{copies}"
        )
    if errors:
        raise errors[0]
    return None


def _load_remote_twice(load_one: Callable[[Any], None], where: Callable[[int, str], Any], step: int, tier: str) -> None:
    """``load_one`` of a copy; one on object storage that fails as damaged is read once more
    before it is taken for damaged (and set aside): an object store's one bad answer (a 404
    from a lagging replica, a body cut short or changed on the way) must not hide a good step
    from every later restore. Every rank raised the same error (a load's failure is agreed),
    so every rank reads again."""
    at = where(step, tier)
    try:
        load_one(at)
    except (CorruptCheckpointError, IncompleteCheckpointError, CheckpointNotFoundError) as e:
        if not isinstance(at, Storage) or isinstance(at, LocalStorage):
            raise
        log.warning("stashpoint: step %d at %s failed to load (%s); reading it once more", step, at.location, _told(e))
        load_one(at)


def restore_reported(mgr: Any, state: Any, step: int | None, strict: bool, options: dict[str, Any]) -> RestoreReport:
    """``CheckpointManager.restore``: :func:`restore_run`, with what was fetched from other
    nodes and the seconds it took."""
    load_one = functools.partial(_load_into, state, strict, options)
    t0 = time.perf_counter()
    with remembering():  # the passes of a restore parse and plan once
        r = restore_run(mgr, state, load_one, step, options)
    if r.step is None and mgr._swept:  # a fresh start where the root held steps: never silently
        log.warning(
            "stashpoint: no committed step in %s to restore: the %d step director%s there held saves that never "
            "committed and %s removed when the manager opened, so training starts afresh (a copy of a run taken "
            "while it saved, with cp -r say, holds such steps: copy a run once it has stopped)",
            mgr.root,
            mgr._swept,
            "y" if mgr._swept == 1 else "ies",
            "was" if mgr._swept == 1 else "were",
        )
        mgr._swept = 0
    nodes = mgr._nodes
    fetched = dict(nodes.fetched) if nodes is not None else {}
    into = nodes.fetched_into if nodes is not None else ""
    return dataclasses.replace(r, fetched=fetched, fetched_into=into, seconds=time.perf_counter() - t0)


def _load_into(state: Any, strict: bool, options: dict[str, Any], at: Storage) -> None:
    load(state, at, strict=strict, **options)


def restore_run(
    mgr: Any, state: Any, load_one: Callable[[Any], None], step: int | None, options: dict[str, Any]
) -> RestoreReport:
    """``CheckpointManager.restore`` of ``state``: the step loaded (None: no checkpoint), the
    tier it came from, and the copies tried."""
    from stashpoint._manager.steps import move_aside

    remote = mgr._tier.remote if mgr._tier is not None else None
    if mgr._nodes is not None:
        report: RestoreReport = mgr._nodes.restore(mgr.storage, state, step, load_one, options, remote)
        mgr._remote_unseen = mgr._nodes.remote_unseen
        return report
    if remote is None and step is not None:
        try:
            load_one(_unlinked(mgr._at(step)))
        except CheckpointNotFoundError as e:
            raise CheckpointNotFoundError(f"{e}; {_held(mgr.steps())}") from None
        return RestoreReport(step, "local", ((step, "local"),), ())

    def remote_live() -> list[int]:  # not the steps of a run gone back from, not yet set aside there
        steps: list[int] = mgr.remote_steps()
        if remote is None:
            return steps
        return live(steps, pending_rewind(mgr.storage, remote.location), remote, mgr.storage)

    if mgr.world == 1:
        remote_steps = reachable(remote_live)
        order, unseen = restore_order(mgr.steps(), remote_steps or [], step), remote_steps is None
    else:  # every rank the same order, from what every rank sees (one listing each, gathered)
        order, unseen = agreed_restore_order(mgr.steps, remote_live, mgr.rank, step, options)
    if unseen and not order and remote is not None:
        raise unseen_remote(remote.location)
    if step is not None and not order:
        order = [(step, "local")]  # raises CheckpointNotFoundError, naming the path

    def where(s: int, tier: str) -> Any:
        return _unlinked(mgr._at(s)) if tier == "local" or mgr._tier is None else mgr._tier.at(s)

    found = try_in_order(order, step, where, load_one)
    mgr._remote_unseen = unseen  # the steps above this one may be the remote tier's: no rewind reaches them
    if found is None:
        return RestoreReport(None, None, tuple(order), ())
    candidate, tier, damaged = found
    if step is None and mgr.rank == 0:
        for s, t, _ in damaged:
            move_aside(mgr.storage if t == "local" or mgr._tier is None else mgr._tier.remote, s)
    return RestoreReport(candidate, tier, tuple(order), tuple(damaged))


def _unlinked(at: Any) -> Any:
    """``at``, a step of the run directory, unless it is a symbolic link (the listing passes such
    a step by, and a restore of it by number must not load a checkpoint from anywhere)."""
    if isinstance(at, LocalStorage) and at.root.is_symlink():
        raise CheckpointError(
            f"{at.root} is a symbolic link; a run directory's steps are never links and a restore does not "
            "follow one: remove it, or load the checkpoint it points to with stashpoint.load"
        )
    return at


def _held(steps: list[int]) -> str:
    """The committed steps a run directory holds, for an error naming a step it lacks."""
    if not steps:
        return "the run directory holds no committed step"
    shown = ("..., " if len(steps) > 10 else "") + ", ".join(str(s) for s in steps[-10:])
    return f"the committed steps there are {shown} (restore(state) loads the newest)"


def _told(e: CheckpointError) -> str:
    """``e``'s message without a plain load's advice to load a good checkpoint: the restore
    loads one in its stead."""
    return str(e).replace(f"\n{PARTLY_LOADED}", "")
