"""How the ranks agree, at the start of each save, on its id and on who writes each chunk.

Runs on the writer thread, inside the background half of a save (``_save/job``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, NoReturn

from stashpoint._core.assign import assign_writers
from stashpoint._core.catalog import catalog_of
from stashpoint._core.described import described_catalog
from stashpoint._core.naming import RANKS_PER_DIR
from stashpoint._dist.commit import Assignment, LayoutMsg, Plan, RankFailure, SaveHello, Start, start_save
from stashpoint._dist.group import DistContext
from stashpoint._save.layout import Layout
from stashpoint._storage import env_number
from stashpoint.errors import CheckpointError


def ranks_per_dir(world: int) -> int:
    """How many ranks' files share a directory in a world of ``world`` ranks: all of them (0, the
    checkpoint's root) up to ``STASHPOINT_RANKS_PER_DIR`` (default 1,024) ranks, that many above."""
    per_dir = int(env_number("STASHPOINT_RANKS_PER_DIR", RANKS_PER_DIR, 1, 1 << 24))
    return per_dir if world > per_dir else 0


@dataclass(frozen=True)
class Agreed:
    """What every rank learns at the start of a save."""

    save_id: str
    given: frozenset[Any]  # the chunks this rank writes
    ranks_per_dir: int  # rank 0's choice for this save (see ``ranks_per_dir()``)


def agree(
    ctx: DistContext,
    layout: Layout,
    *,
    location: str,
    seq: int,
    staged_keys: frozenset[str] | None,
    early_error: BaseException | None,
) -> Agreed:
    """Agree with the other ranks on this save and on who writes what: the last plan when
    every rank's layout is the same as then and every rank copied its part of it, else a
    new one.

    Every rank sends rank 0 a small hello and gets its answer. A new plan comes from the
    ranks' descriptions where every rank has one (one broadcast per distinct description,
    ``_core.described``), else each rank sends its layout to rank 0 alone, which answers
    each with its own part. ``location`` must be alike on every rank; ``staged_keys`` are the
    keys this rank copied (None: every key); ``early_error`` fails the save on every rank."""
    err = None if early_error is None else f"{type(early_error).__name__}: {early_error}"
    last: Plan | None = ctx.last_plan
    desc = layout.description if ctx.world_numbered else None
    covers = staged_keys is None or (last is not None and layout.given(last.mine) <= staged_keys)
    mine = SaveHello(
        layout.hash,
        uuid.uuid4().hex[:16],
        seq,
        location,
        err,
        covers,
        None if desc is None else desc.digest,
        staged_keys is None,
    )
    hellos: list[SaveHello] | None = ctx.gather("save hellos", mine)
    start = None
    if hellos is not None:  # rank 0 decides, and its answer reaches every rank even on a bad setting
        try:
            start = start_save(ctx, hellos, last, ctx.plan_constrained, ranks_per_dir(ctx.world))
        except ValueError as e:
            start = Start("", False, ((0, str(e)),))
    start = ctx.broadcast("save start", start)
    assert isinstance(start, Start)
    if start.failed:
        raise RankFailure(list(start.failed))
    if start.reuse:
        assert last is not None
        return Agreed(start.save_id, last.mine, start.ranks_per_dir)
    hashes = None if hellos is None else tuple(h.layout_hash for h in hellos)
    if start.described is not None:
        reps, members = start.described
        descs = [ctx.broadcast("description", desc if ctx.rank == r else None, src=r) for r in reps]
        try:
            described = described_catalog(descs, members)
        except CheckpointError as e:
            _failed(ctx, layout, str(e))
        if described is not None:  # else (alike on every rank) the general path below
            given = frozenset(c.ident for c in layout.chunks if described.writes(*c.ident, ctx.rank))
            catalog = described.catalog if ctx.rank == 0 else None
            _planned(ctx, Plan(layout.hash, given, hashes, catalog), False)
            ctx.plans_described += 1
            return Agreed(start.save_id, given, start.ranks_per_dir)
    staged = None if staged_keys is None else tuple(c.ident for c in layout.chunks if c.key in staged_keys)
    layouts: list[LayoutMsg] | None = ctx.gather("layouts", layout.message(staged))
    parts: list[Assignment] | None = None
    writers: dict[Any, int] | None = None
    catalog = None
    if layouts is not None:
        copied = [None if m.copied is None else set(m.copied) for m in layouts]
        try:
            writers = assign_writers([m.chunks for m in layouts], copied)
            keyinfo = (kv for m in layouts for kv in m.keyinfo.items())
            catalog = catalog_of(keyinfo, (kv for m in layouts for kv in m.aliases.items()), writers)
            given_to: list[set[Any]] = [set() for _ in layouts]
            for ident, rank in writers.items():
                given_to[rank].add(ident)
            constrained = any(c is not None for c in copied)
            parts = [Assignment(frozenset(g), constrained) for g in given_to]
        except (CheckpointError, ValueError) as e:
            parts = [Assignment(frozenset(), error=str(e))] * ctx.world
    part: Assignment = ctx.scatter("assignments", parts)
    if part.error is not None:
        _failed(ctx, layout, part.error)
    _planned(ctx, Plan(layout.hash, part.mine, hashes, catalog), part.constrained)
    return Agreed(start.save_id, part.mine, start.ranks_per_dir)


def _planned(ctx: DistContext, plan: Plan, constrained: bool) -> None:
    ctx.last_plan = plan
    ctx.plan_constrained = constrained
    ctx.plans_made += 1


def _failed(ctx: DistContext, layout: Layout, error: str) -> NoReturn:
    # on every rank alike: the next save copies everything everywhere, and this layout
    # always will (a structure that did this once may do it again, e.g. saved in turn)
    ctx.last_plan = None
    if len(ctx.copy_all) < 64:
        ctx.copy_all.add(layout.hash)
    raise CheckpointError(error)
