"""The catalog of a version-2 manifest: per tensor, where its chunks are and who wrote them.

A regular layout (a tensor saved whole, a replicated tensor written by one rank, FSDP2's even
row blocks, a 2-D sharding) is a :class:`Grid`: a few numbers whatever the number of ranks, and
the chunks that overlap a region are found by arithmetic on its bounds. Any other layout lists
each chunk's box and writer. Pure functions, no I/O.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from stashpoint._core.reshard import Box, intersect

Cell = tuple[tuple[int, ...], tuple[int, ...], int]  # a chunk's offsets, shape and writing rank


@dataclass(frozen=True)
class Grid:
    """A regular layout: chunks of ``block`` elements per dimension (the last ones shorter),
    the chunk at cell ``(i0, i1, ...)`` written by rank ``base + sum(strides[d] * i[d])``."""

    block: tuple[int, ...]
    base: int
    strides: tuple[int, ...]

    def counts(self, shape: Sequence[int]) -> tuple[int, ...]:
        return tuple(-(-n // b) for n, b in zip(shape, self.block))

    def writer(self, cell: Sequence[int]) -> int:
        return self.base + sum(s * i for s, i in zip(self.strides, cell))


@dataclass(frozen=True)
class Placement:
    """A catalog entry: a tensor's dtype, global shape, and where its chunks are (a grid, or
    each chunk's box and writer), or the key whose bytes it shares."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    grid: Grid | None = None
    cells: tuple[Cell, ...] = ()
    alias_of: str | None = None

    def overlapping(self, region: Box) -> Iterator[tuple[Box, int]]:
        """The stored chunks that overlap ``region`` and their writers: for a grid, computed
        from the region's bounds (as many steps as chunks found)."""
        if region.numel == 0:
            return
        if self.grid is None:
            for off, shp, writer in self.cells:
                box = Box(off, shp)
                if intersect(box, region) is not None:
                    yield box, writer
            return
        b = self.grid.block
        if b == self.shape:  # one cell, the tensor saved whole (most entries)
            yield Box.whole(self.shape), self.grid.base
            return
        spans = [range(o // k, -(-(o + n) // k)) for o, n, k in zip(region.offsets, region.shape, b)]
        for cell in itertools.product(*spans):
            off = tuple(i * k for i, k in zip(cell, b))
            shp = tuple(min(k, n - o) for k, n, o in zip(b, self.shape, off))
            yield Box(off, shp), self.grid.writer(cell)

    @functools.cached_property
    def _cell_set(self) -> frozenset[Cell]:
        return frozenset(self.cells)

    def expects(self, box: Box, rank: int) -> bool:
        """Whether the catalog says ``rank`` writes a chunk of exactly ``box``."""
        if not len(box.offsets) == len(box.shape) == len(self.shape):
            return False
        if self.grid is None:
            return (box.offsets, box.shape, rank) in self._cell_set
        b = self.grid.block
        if b == self.shape:  # one cell, the tensor saved whole (most entries)
            return box.shape == b and not any(box.offsets) and all(b) and self.grid.base == rank
        if not any(box.offsets):  # the first cell
            first = tuple(min(k, n) for k, n in zip(b, self.shape))
            return first == box.shape and all(self.shape) and self.grid.base == rank
        if any(o % k for o, k in zip(box.offsets, b)):
            return False
        cell = tuple(o // k for o, k in zip(box.offsets, b))
        want = tuple(min(k, n - o) for k, n, o in zip(b, self.shape, box.offsets))
        return (
            want == box.shape
            and all(i < c for i, c in zip(cell, self.grid.counts(self.shape)))
            and (self.grid.writer(cell) == rank)
        )


def compact(shape: tuple[int, ...], cells: Sequence[Cell]) -> Grid | None:
    """The grid the non-empty ``cells`` form, or None when they form none (irregular)."""
    full = [c for c in cells if math.prod(c[1]) > 0]
    if not full or math.prod(shape) == 0:
        return None
    block = tuple(max(c[1][d] for c in full) for d in range(len(shape)))
    counts = tuple(-(-n // b) for n, b in zip(shape, block))
    if math.prod(counts) != len(full):
        return None
    at: dict[tuple[int, ...], int] = {}
    for off, shp, writer in full:
        if any(o % b or s != min(b, n - o) for o, s, b, n in zip(off, shp, block, shape)):
            return None
        at[tuple(o // b for o, b in zip(off, block))] = writer
    if len(at) != len(full):
        return None
    base = at[(0,) * len(shape)]
    unit = [tuple(int(d == e) for e in range(len(shape))) for d in range(len(shape))]
    strides = tuple(at[u] - base if c > 1 else 0 for u, c in zip(unit, counts))
    grid = Grid(block, base, strides)
    return grid if all(grid.writer(cell) == w for cell, w in at.items()) else None


def placement(key: str, dtype: str, shape: tuple[int, ...], cells: Sequence[Cell]) -> Placement:
    """The catalog entry of a tensor stored as ``cells`` (a grid where they form one)."""
    grid = compact(shape, cells)
    kept = () if grid is not None else tuple(sorted(c for c in cells if math.prod(c[1]) > 0))
    return Placement(key, dtype, shape, grid, kept)


def catalog_of(
    keyinfo: Iterable[tuple[str, tuple[str, tuple[int, ...]]]],
    aliases: Iterable[tuple[str, str]],
    writers: Mapping[tuple[str, tuple[int, ...], tuple[int, ...]], int],
) -> dict[str, Placement]:
    """The catalog of a save: each key's dtype and global shape (``keyinfo``, the first seen
    wins), where its chunks are (``writers``: who writes each (key, offsets, shape)), or else
    the key it aliases."""
    info: dict[str, tuple[str, tuple[int, ...]]] = {}
    for key, kinfo in keyinfo:
        info.setdefault(key, kinfo)
    alias: dict[str, str] = {}
    for key, target in aliases:
        alias.setdefault(key, target)
    cells: dict[str, list[Cell]] = {}
    for (key, off, shp), rank in writers.items():
        cells.setdefault(key, []).append((off, shp, rank))
    out = {}
    for key, (dtype, shape) in info.items():
        own = cells.get(key)
        if own is not None and key in alias:  # no manifest could say where its bytes are: none is committed
            raise ValueError(
                f"{key!r} is a tensor of its own on some ranks and holds the bytes of {alias[key]!r} on others: "
                "give every rank the same tensors under the same keys (tied on all of them, or on none)"
            )
        if own is not None:
            out[key] = placement(key, dtype, shape, own)
        else:
            out[key] = Placement(key, dtype, shape, alias_of=alias[key])
    return out
