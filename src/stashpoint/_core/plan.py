"""Pure planning: which tensors are written, into which shard file, at which byte offsets.

Nothing here touches tensor data or storage; the functions take and return frozen records, so
they are cheap to cache per state structure and easy to property-test.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TensorSpec:
    """What planning needs to know of a tensor."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    itemsize: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class Placement:
    """A tensor's byte range ``[begin, end)`` inside a shard's data section."""

    key: str
    begin: int
    end: int


@dataclass(frozen=True)
class FilePlan:
    """One shard file: its tensors in order and the size of its data section."""

    index: int
    placements: tuple[Placement, ...]
    data_size: int


@dataclass(frozen=True)
class SavePlan:
    """The shard files one rank writes."""

    rank: int
    files: tuple[FilePlan, ...]


def group_aliases(signatures: Sequence[Hashable | None]) -> list[int | None]:
    """For each item, the index of the first earlier item with the same signature, else None.

    A signature of None never matches (used for empty tensors, which own no memory).
    """
    first: dict[Hashable, int] = {}
    out: list[int | None] = []
    for i, sig in enumerate(signatures):
        if sig is None:
            out.append(None)
            continue
        j = first.setdefault(sig, i)
        out.append(None if j == i else j)
    return out


def plan_files(specs: Sequence[TensorSpec], *, max_file_bytes: int, rank: int = 0) -> SavePlan:
    """Lay tensors out into shard files of at most ``max_file_bytes`` data bytes each.

    Tensors are ordered by element size, largest first (stable otherwise), so every tensor starts
    at an offset that is a multiple of its element size with no padding between tensors — the
    safetensors layout requires a gap-free data section. A tensor larger than the limit gets a
    file of its own.
    """
    if max_file_bytes <= 0:
        raise ValueError(f"max_file_bytes must be positive, got {max_file_bytes}")
    ordered = sorted(specs, key=lambda s: -s.itemsize)
    files: list[FilePlan] = []
    current: list[Placement] = []
    offset = 0
    for spec in ordered:
        n = spec.nbytes
        if current and offset + n > max_file_bytes:
            files.append(FilePlan(len(files), tuple(current), offset))
            current, offset = [], 0
        current.append(Placement(spec.key, offset, offset + n))
        offset += n
    if current or not files:
        files.append(FilePlan(len(files), tuple(current), offset))
    return SavePlan(rank, tuple(files))
