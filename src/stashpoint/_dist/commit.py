"""The messages ranks exchange during a save or an upload, and the one protocol that ends both:
every rank reports its outcome, rank 0 commits only if all succeeded, and tells the others."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from stashpoint._core.assign import ChunkMeta
from stashpoint._core.format import FileEntry
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


@dataclass(frozen=True)
class LayoutMsg:
    """A rank's tensor layout: its chunks, aliases and each key's dtype and global shape."""

    chunks: tuple[ChunkMeta, ...]
    aliases: dict[str, str]
    keyinfo: dict[str, tuple[str, tuple[int, ...]]]
    copied: tuple[Any, ...] | None  # the chunk idents it copied for this save; None: all


@dataclass(frozen=True)
class Plan:
    """Who writes what, and for which layouts (kept to be reused by the next save)."""

    hashes: tuple[str, ...]
    layouts: tuple[LayoutMsg, ...]
    writers: dict[Any, int]


@dataclass(frozen=True)
class Written:
    """What a rank wrote: its files, each key's byte range and checksums, its state tree."""

    files: tuple[FileEntry, ...]
    chunks: dict[str, tuple[str, int, int, tuple[str, ...]]]
    tree: dict[str, Any]
    nbytes: int


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


def check_hellos(ctx: DistContext, hellos: Sequence[SaveHello]) -> None:
    """Raise :class:`RankFailure` if a rank failed before the save, or the ranks are at
    different saves."""
    failed = [(r, h.error) for r, h in enumerate(hellos) if h.error is not None]
    if failed:
        raise RankFailure(failed)
    if len({(h.seq, h.location) for h in hellos}) > 1:
        seen = ", ".join(f"rank {r}: save #{h.seq} to {h.location}" for r, h in enumerate(hellos))
        raise RankFailure([(ctx.rank, f"the ranks are out of step ({seen}); every rank must make the same saves")])


def finish_together(
    ctx: DistContext, what: str, mine: Outcome, commit: Callable[[list[Outcome]], None], local: BaseException | None
) -> list[Outcome]:
    """Gather every rank's outcome; if all succeeded, rank 0 runs ``commit`` and broadcasts
    whether it did. Raises :class:`RankFailure` on every rank alike when any rank failed or the
    commit failed; returns the outcomes otherwise."""
    outcomes: list[Outcome] = ctx.all_gather(f"{what} outcomes", mine)
    failed = [(r, o.error) for r, o in enumerate(outcomes) if o.error is not None]
    if failed:
        raise RankFailure(failed, local, decided=True)
    result = None
    if ctx.rank == 0:
        try:
            commit(outcomes)
        except Exception as e:
            local, result = e, f"{type(e).__name__}: {e}"
    result = ctx.broadcast(f"{what} commit", result)
    if result is not None:
        raise RankFailure([(0, f"committing: {result}")], local)
    return outcomes
