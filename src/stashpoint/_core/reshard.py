"""Pure resharding math: which bytes of a stored chunk a destination region needs.

A tensor is stored as chunks, each a box of the global tensor (offsets and shape) laid out
row-major. A destination (a rank's local shard, or a whole tensor) is another box. Loading
copies every intersection of a stored box with a wanted box; these functions say where the
intersection's bytes lie inside the stored chunk, so a rank reads only what it needs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Box:
    """A region of a tensor: ``offsets`` and ``shape`` per dimension, in global coordinates."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        return cls((0,) * len(shape), tuple(shape))


def intersect(a: Box, b: Box) -> Box | None:
    """The region both boxes cover, or None if they do not overlap (or it is empty)."""
    if a == b:  # the usual case: a whole tensor read from its one chunk
        return a if all(a.shape) else None
    if len(a.shape) != len(b.shape):
        raise ValueError(f"boxes of different ranks: {a} and {b}")
    offsets, shape = [], []
    for ao, an, bo, bn in zip(a.offsets, a.shape, b.offsets, b.shape):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if hi <= lo:
            return None
        offsets.append(lo)
        shape.append(hi - lo)
    return Box(tuple(offsets), tuple(shape))


def local(region: Box, within: Box) -> Box:
    """``region`` in the coordinates of the box ``within`` (which contains it)."""
    return Box(tuple(r - w for r, w in zip(region.offsets, within.offsets)), region.shape)


def runs(chunk: Box, region: Box, itemsize: int) -> Iterator[tuple[int, int]]:
    """Byte ranges ``(begin, end)``, relative to the start of ``chunk``'s bytes, that hold
    ``region`` (a sub-box of ``chunk``), in the row-major order of ``region``; adjacent ranges
    are merged. Concatenated, they are ``region``'s bytes laid out row-major."""
    ndim = len(chunk.shape)
    if region.numel == 0:
        return
    if ndim == 0:
        yield 0, itemsize
        return
    start = [r - c for r, c in zip(region.offsets, chunk.offsets)]
    strides = [math.prod(chunk.shape[d + 1 :]) for d in range(ndim)]
    # k: the first dimension from which on the region spans the chunk fully, minus one
    k = ndim - 1
    while k > 0 and region.shape[k] == chunk.shape[k]:
        k -= 1
    run = region.shape[k] * strides[k] * itemsize
    outer = region.shape[:k]
    pending: tuple[int, int] | None = None
    for idx in _ndindex(outer):
        elem = start[k] * strides[k] + sum((start[d] + i) * strides[d] for d, i in enumerate(idx))
        b = elem * itemsize
        if pending is not None and pending[1] == b:
            pending = (pending[0], b + run)
            continue
        if pending is not None:
            yield pending
        pending = (b, b + run)
    if pending is not None:
        yield pending


def _ndindex(shape: Sequence[int]) -> Iterator[tuple[int, ...]]:
    if not shape:
        yield ()
        return
    for i in range(shape[0]):
        for rest in _ndindex(shape[1:]):
            yield (i, *rest)


def block_spans(ranges: Sequence[tuple[int, int]], block: int, total: int) -> list[tuple[int, int]]:
    """The checksum blocks (``block`` bytes each, the last one shorter) that cover ``ranges``,
    merged into spans ``(begin, end)`` of a ``total``-byte chunk."""
    spans: list[tuple[int, int]] = []
    for b, e in ranges:
        if e <= b:
            continue
        lo, hi = (b // block) * block, min(-(-e // block) * block, total)
        if spans and lo <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], hi))
        else:
            spans.append((lo, hi))
    return spans


def block_count(nbytes: int, block: int) -> int:
    """How many checksum blocks a chunk of ``nbytes`` has (at least one, for empty chunks)."""
    return max(1, -(-nbytes // block))
