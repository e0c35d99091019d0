"""Who does what, decided alike on every rank from the same inputs: which rank writes each chunk
of a save, which rank reads each region every rank wants, and which ranks share one state tree."""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from stashpoint._core.reshard import Box
from stashpoint.errors import CheckpointError


@dataclass(frozen=True)
class ChunkMeta:
    """A chunk one rank holds: its place in the global tensor."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    itemsize: int
    # written by the lowest rank that holds it: a module buffer, which ranks may each update on
    # their own data (BatchNorm's running stats), is saved as rank 0 has it, like torch.save on rank 0
    lowest: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def ident(self) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        return (self.key, self.offsets, self.shape)


Ident = tuple[str, tuple[int, ...], tuple[int, ...]]  # ChunkMeta.ident: key, offsets, shape
# Replicated chunks this small (scalars: an optimizer's step counts) go to their lowest holder:
# spread over R ranks, every loader would read R indexes and files for a few bytes each.
SMALL_CHUNK_BYTES = 256


def assign_writers(
    per_rank: Sequence[Sequence[ChunkMeta]], staged: Sequence[Collection[Ident] | None] | None = None
) -> dict[Ident, int]:
    """Who writes each distinct chunk: one holder each, balancing the bytes written per rank.

    Chunks held by several ranks (replicated tensors, ``Replicate`` placements) are written once.
    Biggest chunks are placed first, each on the holder that has the least to write so far
    (ties: the lowest rank), so N ranks holding S replicated bytes write about S/N each; a chunk
    marked ``lowest`` (a module buffer), or of at most ``SMALL_CHUNK_BYTES``, goes to its lowest
    holder.

    ``staged``, per rank, the chunks that rank copied for this save (None: all it holds): a chunk
    goes only to a holder that copied it. Ranks copy only what the last plan gave them once a
    structure's plan is known (see ``_save``), so when some rank's layout changed and a new plan
    is needed, each chunk still goes to a rank that has its bytes.

    Raises :class:`CheckpointError` when ranks disagree on a key's dtype or global shape, or when
    no holder of a chunk copied it.
    """
    holders: dict[Ident, list[int]] = {}
    meta: dict[Ident, ChunkMeta] = {}
    seen: dict[str, tuple[int, ChunkMeta]] = {}
    problems = []
    for rank, chunks in enumerate(per_rank):
        mine = None if staged is None else staged[rank]
        for c in chunks:
            first = seen.setdefault(c.key, (rank, c))
            if (first[1].dtype, first[1].global_shape) != (c.dtype, c.global_shape):
                problems.append(
                    f"{c.key!r} is {first[1].dtype}{list(first[1].global_shape)} on rank {first[0]} but "
                    f"{c.dtype}{list(c.global_shape)} on rank {rank}"
                )
            meta.setdefault(c.ident, c)
            ranks = holders.setdefault(c.ident, [])
            if mine is None or c.ident in mine:
                ranks.append(rank)
    if problems:
        raise CheckpointError(
            "ranks disagree on tensors saved under the same key (a tensor under one key on several ranks is "
            "taken as a replica; give per-rank tensors per-rank keys): " + "; ".join(problems[:10])
        )
    uncopied = sorted({i[0] for i, ranks in holders.items() if not ranks})
    if uncopied:
        raise CheckpointError(
            f"no rank copied {', '.join(repr(k) for k in uncopied[:10])}{' ...' if len(uncopied) > 10 else ''} "
            "for this save: the rank the last save's plan gave them to no longer holds them, and the ranks that "
            "still do copied only their own part (their states changed unevenly between saves). Nothing was "
            "committed; the next save copies every tensor on every rank and commits."
        )
    load = [0] * len(per_rank)
    out = {}
    for ident in sorted(holders, key=lambda i: (-meta[i].nbytes, i)):
        small = meta[ident].nbytes <= SMALL_CHUNK_BYTES
        rank = min(holders[ident]) if meta[ident].lowest or small else min(holders[ident], key=lambda r: (load[r], r))
        out[ident] = rank
        load[rank] += meta[ident].nbytes
    return out


def layout_hash(chunks: Sequence[ChunkMeta], aliases: dict[str, str]) -> str:
    return xxhash.xxh3_128_hexdigest(repr((list(chunks), sorted(aliases.items()))).encode())


def merge_trees(trees: Sequence[dict[str, Any]]) -> tuple[tuple[dict[str, Any], ...], tuple[int, ...]]:
    """Distinct trees and, per rank, the index of its tree (identical trees are stored once)."""
    distinct: list[dict[str, Any]] = []
    index: dict[str, int] = {}
    of_rank = []
    for t in trees:
        h = xxhash.xxh3_128_hexdigest(repr(t).encode())
        if h not in index:
            index[h] = len(distinct)
            distinct.append(t)
        of_rank.append(index[h])
    return tuple(distinct), tuple(of_rank)


Item = tuple[str, Box]  # (key, region)


#: The bytes of replicated regions per reader that make another rank a reader: one exchange
#: window, so that small states go out in a few broadcasts, not one per rank.
READ_SHARE_FLOOR = 64 * 1024 * 1024


def assign_readers(wanted: Mapping[Item, int], world: int, floor: int = READ_SHARE_FLOOR) -> dict[Item, int]:
    """For each region every rank wants (``wanted`` maps item -> bytes, alike on every rank),
    the rank that reads it and broadcasts it: the first ``k`` ranks read, as many as the bytes
    need at ``floor`` each (every rank for a large state, one for a small one), and each item,
    biggest first, goes to the one of them with the fewest bytes so far (ties: the lowest rank),
    so no reader takes more than an even share and one item. O(items log k), whatever the
    world size."""
    total = sum(wanted.values())
    readers = max(1, min(world, -(-total // max(1, floor))))
    heap = [(0, r) for r in range(readers)]  # already a heap: (bytes so far, rank)
    out: dict[Item, int] = {}
    for item in sorted(wanted, key=lambda i: (-wanted[i], i[0], i[1].offsets, i[1].shape)):
        load, rank = heapq.heappop(heap)
        out[item] = rank
        heapq.heappush(heap, (load + wanted[item], rank))
    return out
