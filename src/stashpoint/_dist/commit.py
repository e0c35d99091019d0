"""The messages ranks exchange during a save or an upload, and the one protocol that ends both:
every rank reports its outcome, rank 0 commits only if all succeeded, and tells the others."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stashpoint._core.assign import ChunkMeta
from stashpoint._core.catalog import Placement
from stashpoint._core.described import MAX_DESCRIPTIONS
from stashpoint._core.index import catalog_json
from stashpoint._core.naming import parse_step_dir
from stashpoint._dist.group import DistContext


@dataclass(frozen=True)
class SaveHello:
    """A rank's opening message of a save: what it saves, and whether it can."""

    layout_hash: str
    save_id: str  # a fresh id proposed by each rank; rank 0's is used
    seq: int  # this rank's count of collective saves: every rank must be at the same one
    location: str
    error: str | None  # this rank failed before staging
    covers_last_plan: bool  # this rank copied everything the last plan gives it to write
    description: str | None = None  # the digest of its layout's description (None: it has none)
    copied_all: bool = True  # it copied every tensor it holds for this save


@dataclass(frozen=True)
class LayoutMsg:
    """A rank's tensor layout: its chunks, aliases and each key's dtype and global shape."""

    chunks: tuple[ChunkMeta, ...]
    aliases: dict[str, str]
    keyinfo: dict[str, tuple[str, tuple[int, ...]]]
    copied: tuple[Any, ...] | None  # the chunk idents it copied for this save; None: all


@dataclass(frozen=True)
class Plan:
    """Who writes what, kept to be reused by the next save of the same layouts. Every rank
    keeps its own part (``mine``); rank 0 also keeps what it decides and commits with."""

    layout_hash: str  # this rank's layout when the plan was made
    mine: frozenset[Any]  # the chunk idents this rank writes
    hashes: tuple[str, ...] | None = None  # rank 0: every rank's layout hash
    catalog: Mapping[str, Placement] | None = None  # rank 0: the manifest's catalog

    @functools.cached_property
    def catalog_json(self) -> bytes | None:
        """The catalog as the manifest holds it: encoded once, for every save that reuses the plan."""
        return None if self.catalog is None else catalog_json(self.catalog)


@dataclass(frozen=True)
class Start:
    """Rank 0's answer to the hellos: the save's id, whether the last plan stands, or why the
    save cannot start (failed ranks, at most ``MAX_NAMED`` of them)."""

    save_id: str
    reuse: bool
    failed: tuple[tuple[int, str], ...] = ()
    ranks_per_dir: int = 0  # the files of each group of this many ranks share a directory (0: one for all)
    # a new plan from descriptions: the rank that broadcasts each distinct one, and per rank
    # (one byte each) which it holds; None: every rank sends its layout to rank 0
    described: tuple[tuple[int, ...], bytes] | None = None


@dataclass(frozen=True)
class Assignment:
    """A new plan's part for one rank: the chunks it writes (or why there is no plan)."""

    mine: frozenset[Any]
    constrained: bool = False
    error: str | None = None


MAX_NAMED = 64  # failed ranks named in one message: bounded whatever the world size


@dataclass(frozen=True)
class Written:
    """What a rank wrote, as rank 0 needs it to commit: its index's size and checksum, and how
    many shard files it wrote (the index itself stays beside the data)."""

    index_size: int
    index_checksum: str
    files: int


@dataclass(frozen=True)
class Outcome:
    """A rank's result of its part: ``error`` is None on success; ``payload`` is what rank 0
    needs to commit."""

    error: str | None = None
    payload: Any = None
    nbytes: int = 0


@dataclass
class RankFailure(Exception):
    """Some ranks failed their part (every rank raises it alike); ``local`` is this rank's own
    exception, if it is one of them."""

    failed: list[tuple[int, str]]
    local: BaseException | None = field(default=None, compare=False)
    decided: bool = False  # every rank knows nothing is committed (the outcomes showed a failure)

    def __str__(self) -> str:
        return "; ".join(f"rank {r}: {cause}" for r, cause in self.failed)


def start_save(
    ctx: DistContext, hellos: Sequence[SaveHello], last: Plan | None, constrained: bool, ranks_per_dir: int = 0
) -> Start:
    """Rank 0: decide from every rank's hello whether and how the save starts (``ranks_per_dir``:
    rank 0's choice of directories, which every rank follows)."""
    failed = [(r, h.error) for r, h in enumerate(hellos) if h.error is not None]
    if failed:
        return Start("", False, _named(failed))
    if len({(h.seq, h.location) for h in hellos}) > 1:
        odd = [(r, h) for r, h in enumerate(hellos) if (h.seq, h.location) != (hellos[0].seq, hellos[0].location)]
        seen = ", ".join(f"rank {r}: save #{h.seq} to {h.location}" for r, h in [(0, hellos[0]), *odd[:8]])
        steps = {parse_step_dir(h.location.rpartition("/")[2]) for h in hellos}
        parents = {h.location.rpartition("/")[0] for h in hellos}
        if len({h.seq for h in hellos}) == 1 and None not in steps and len(parents) == 1:  # a manager's steps
            shown = ", ".join(
                f"rank {r}: step {parse_step_dir(h.location.rpartition('/')[2])}" for r, h in [(0, hellos[0]), *odd[:8]]
            )
            why = (
                f"the ranks saved different steps to one run ({shown}); every rank must save the same step "
                "(a CheckpointManager's save(step, ...) is collective)"
            )
        elif len({h.seq for h in hellos}) == 1:  # the same save, to places of their own
            why = (
                f"the ranks passed different paths to one save ({seen}); pass the same path on every rank, "
                "spelled alike (a link or '..' spelling one directory otherwise counts as another): "
                "stashpoint writes each rank's files there itself, and a load on any number of ranks reads "
                "what each one needs"
            )
        else:
            why = (
                f"the ranks are out of step ({seen}); every rank must make the same saves: after a save some ranks "
                "made and others did not, the ranks' later saves pair up out of step (collectives pair by order) "
                "until the job restarts from its last committed checkpoint"
            )
        return Start("", False, ((0, why),))
    hashes = tuple(h.layout_hash for h in hellos)
    reuse = last is not None and last.hashes == hashes and not constrained and all(h.covers_last_plan for h in hellos)
    return Start(hellos[0].save_id, reuse, ranks_per_dir=ranks_per_dir, described=None if reuse else _described(hellos))


def _described(hellos: Sequence[SaveHello]) -> tuple[tuple[int, ...], bytes] | None:
    """Who broadcasts each distinct description, and which each rank holds; None when some
    rank has none, copied only part of its state, or there are too many distinct ones."""
    if any(h.description is None or not h.copied_all for h in hellos):
        return None
    first: dict[str | None, int] = {}
    for rank, h in enumerate(hellos):
        first.setdefault(h.description, rank)
    if len(first) > MAX_DESCRIPTIONS:
        return None
    index = {d: i for i, d in enumerate(first)}
    return tuple(first.values()), bytes(index[h.description] for h in hellos)


def _named(failed: list[tuple[int, str]]) -> tuple[tuple[int, str], ...]:
    shown = failed[:MAX_NAMED]
    if len(failed) > MAX_NAMED:
        shown.append((failed[MAX_NAMED][0], f"... and {len(failed) - MAX_NAMED} more rank(s) failed"))
    return tuple(shown)


@dataclass(frozen=True)
class _Verdict:
    failed: tuple[tuple[int, str], ...] = ()
    commit_error: str | None = None
    summary: Any = None


def finish_together(
    ctx: DistContext, what: str, mine: Outcome, commit: Callable[[list[Outcome]], Any], local: BaseException | None
) -> Any:
    """Gather every rank's outcome on rank 0; if all succeeded, rank 0 runs ``commit`` and
    tells every rank what it returned (or that it failed). Raises :class:`RankFailure` on every
    rank alike when any rank failed or the commit failed. Each rank sends one outcome and
    receives one answer: only rank 0 sees all R outcomes."""
    outcomes: list[Outcome] | None = ctx.gather(f"{what} outcomes", mine)
    verdict = _Verdict()
    if outcomes is not None:
        failed = [(r, o.error) for r, o in enumerate(outcomes) if o.error is not None]
        if failed:
            verdict = _Verdict(failed=_named(failed))
        else:
            try:
                verdict = _Verdict(summary=commit(outcomes))
            except Exception as e:
                local, verdict = e, _Verdict(commit_error=f"{type(e).__name__}: {e}")
    verdict = ctx.broadcast(f"{what} commit", verdict)
    if verdict.failed:
        raise RankFailure(list(verdict.failed), local, decided=True)
    if verdict.commit_error is not None:
        raise RankFailure([(0, f"committing: {verdict.commit_error}")], local)
    return verdict.summary
