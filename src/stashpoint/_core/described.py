"""A structure's first plan from *descriptions*: who writes what, without every rank's chunks.

Sending every rank's chunk list to rank 0 makes the first save of a structure cost R x T on
rank 0 (1.2 GB received and minutes of assignment at 16,384 ranks and 1,000 tensors). Most
states need none of it: a DTensor on a regular device mesh places every rank's shard by
arithmetic, and a plain tensor is whole on each rank that holds it. A rank's *description*
says, per tensor, its dtype, global shape and how it is spread (mesh and placements), and the
same for every rank of an FSDP2, TP, HSDP or DDP job: rank 0 groups the ranks by description,
one rank of each distinct description broadcasts it, and every rank works out the same plan
from them — each DTensor's chunks as one :class:`Grid` (a replica chosen per tensor by a hash
of its key), each plain tensor given to one of its holders, balancing bytes. Anything else
(irregular placements, a constrained plan) takes the general path (``assign_writers``).
Pure functions, no I/O.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from stashpoint._core.assign import SMALL_CHUNK_BYTES
from stashpoint._core.catalog import Grid, Placement
from stashpoint._core.reshard import Box
from stashpoint.errors import CheckpointError

MAX_DESCRIPTIONS = 255  # distinct descriptions in one plan (a membership byte per rank); more: the general path


@dataclass(frozen=True)
class Spread:
    """A DTensor's layout on an affine device mesh: the mesh's shape, the rank at coordinate 0
    and each mesh dim's rank stride; per mesh dim the tensor dim it shards (None: replicated)."""

    mesh_shape: tuple[int, ...]
    mesh_base: int
    mesh_strides: tuple[int, ...]
    dims: tuple[int | None, ...]


@dataclass(frozen=True)
class KeyDesc:
    """One stored tensor of a rank's description."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    itemsize: int
    spread: Spread | None  # None: a plain tensor, whole on every rank that holds it
    lowest: bool = False  # written by its lowest holder (a module buffer)


@dataclass(frozen=True)
class Description:
    """What a rank stores, the same on every rank of a regular parallelism."""

    keys: tuple[KeyDesc, ...]
    aliases: tuple[tuple[str, str], ...]  # key -> the key whose bytes it shares

    @functools.cached_property
    def digest(self) -> str:
        """Sent in every save's hello: worked out once per description (layouts are cached)."""
        return xxhash.xxh3_128_hexdigest(repr(self).encode())


def spread_grid(d: KeyDesc) -> Grid | None:
    """The grid of a DTensor's chunks (torch's chunking: ``ceil(n / m)`` rows per mesh
    coordinate, the last ones shorter or empty) and their writers: the ranks at one replica
    coordinate, chosen per tensor by a hash of its key (the first replica for small tensors and
    module buffers). None for a tensor of no elements, or one with a dim sharded by several
    mesh dims (no grid describes that)."""
    s = d.spread
    assert s is not None
    if math.prod(d.shape) == 0:
        return None
    sharded = [dim for dim in s.dims if dim is not None]
    if len(set(sharded)) != len(sharded):
        return None
    block, strides = list(d.shape), [0] * len(d.shape)
    for k, dim in enumerate(s.dims):
        if dim is not None:
            block[dim] = -(-d.shape[dim] // s.mesh_shape[k])
            if block[dim] < d.shape[dim]:  # more than one cell along it
                strides[dim] = s.mesh_strides[k]
    base = s.mesh_base
    if not (d.lowest or math.prod(block) * d.itemsize <= SMALL_CHUNK_BYTES):
        h = xxhash.xxh3_64_intdigest(d.key.encode())
        for k, dim in enumerate(s.dims):
            if dim is None:
                h, coord = divmod(h, s.mesh_shape[k])
                base += coord * s.mesh_strides[k]
    return Grid(tuple(block), base, tuple(strides))


@dataclass(frozen=True)
class DescribedPlan:
    """A plan made from descriptions: the save's catalog, and who writes the (empty) chunk of
    each tensor of no elements, so that every tensor has one, as the general plan gives."""

    catalog: dict[str, Placement]
    empty: dict[str, int]

    def writes(self, key: str, offsets: tuple[int, ...], shape: tuple[int, ...], rank: int) -> bool:
        """Whether ``rank`` writes its chunk ``(offsets, shape)`` of ``key`` (an empty chunk of a
        tensor with elements: nobody, the catalog needs none)."""
        if key in self.empty:
            return self.empty[key] == rank
        return math.prod(shape) > 0 and self.catalog[key].expects(Box(offsets, shape), rank)


def described_catalog(descs: Sequence[Description], members: Sequence[int]) -> DescribedPlan | None:
    """The plan of a save whose ranks sent ``descs`` (rank ``r`` holds ``descs[members[r]]``):
    where every chunk is and who writes it. None when the descriptions cannot make one (a key
    spread differently by different ranks, an irregular spread): the general path plans then.

    Raises :class:`CheckpointError` when ranks disagree on a key's dtype or global shape."""
    holders: list[list[int]] = [[] for _ in descs]
    for rank, i in enumerate(members):
        holders[i].append(rank)
    stored: dict[str, tuple[KeyDesc, list[int]]] = {}  # key -> its description, the descriptions holding it
    aliases: dict[str, str] = {}
    problems = []
    for i, desc in enumerate(descs):
        if not holders[i]:
            continue
        for kd in desc.keys:
            first = stored.get(kd.key)
            if first is None:  # (few records per key: tens of thousands set off collections of the heap)
                stored[kd.key] = (kd, [i])
                continue
            if first[0].dtype != kd.dtype or first[0].shape != kd.shape:
                problems.append(
                    f"{kd.key!r} is {first[0].dtype}{list(first[0].shape)} on rank {holders[first[1][0]][0]} "
                    f"but {kd.dtype}{list(kd.shape)} on rank {holders[i][0]}"
                )
            elif first[0] != kd:
                return None
            first[1].append(i)
        for key, target in desc.aliases:
            if aliases.setdefault(key, target) != target:
                return None
    if problems:
        raise CheckpointError(
            "ranks disagree on tensors saved under the same key (a tensor under one key on several ranks is "
            "taken as a replica; give per-rank tensors per-rank keys): " + "; ".join(problems[:10])
        )
    if aliases.keys() & stored.keys() or not set(aliases.values()) <= stored.keys():
        return None
    out: dict[str, Placement] = {}
    empty: dict[str, int] = {}
    plain: list[tuple[KeyDesc, tuple[int, ...]]] = []
    covered: dict[tuple[tuple[int, ...], Spread], bool] = {}
    held: dict[tuple[int, ...], tuple[int, ...]] = {}  # one tuple per distinct set of descriptions
    for key, (kd, where) in stored.items():
        w = tuple(where)
        held_by = held.get(w) or held.setdefault(w, tuple(sorted(set(w))))
        if math.prod(kd.shape) == 0:
            out[key] = Placement(key, kd.dtype, kd.shape)
            empty[key] = min(holders[i][0] for i in held_by)
        elif kd.spread is None:
            plain.append((kd, held_by))
        else:
            grid = spread_grid(kd)
            mesh_ok = covered.get((held_by, kd.spread))
            if mesh_ok is None:
                mesh_ok = covered[held_by, kd.spread] = _holds_mesh(kd.spread, held_by, holders, len(members))
            if grid is None or not mesh_ok:
                return None
            out[key] = Placement(key, kd.dtype, kd.shape, grid)
    out.update(_plain_writers(plain, holders))
    for key, target in aliases.items():
        t = out[target]
        out[key] = Placement(key, t.dtype, t.shape, alias_of=target)
    return DescribedPlan(out, empty)


def _holds_mesh(s: Spread, where: tuple[int, ...], holders: list[list[int]], world: int) -> bool:
    """Whether every rank of the mesh ``s`` is in the world and holds a description among
    ``where``: a grid gives each of them a chunk to write, so none may lack the tensor. Checked
    once per distinct (mesh, descriptions) pair, not per tensor."""
    ranks = {s.mesh_base}
    for n, stride in zip(s.mesh_shape, s.mesh_strides):
        ranks = {r + i * stride for r in ranks for i in range(n)}
    if min(ranks) < 0 or max(ranks) >= world:
        return False
    if len(where) == len(holders):
        return True
    have = {r for i in where for r in holders[i]}
    return ranks <= have


def _plain_writers(plain: list[tuple[KeyDesc, tuple[int, ...]]], holders: list[list[int]]) -> dict[str, Placement]:
    """One writer per plain tensor among the ranks holding it: biggest first, each to the
    holder with the fewest bytes so far (ties: the lowest rank); module buffers and tensors of
    at most ``SMALL_CHUNK_BYTES`` to their lowest holder. A heap per set of descriptions holding
    tensors (usually one), so each choice costs log R, not R."""
    load: dict[int, int] = {}
    heaps: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    lowest: dict[tuple[int, ...], int] = {}
    zeros = {n: (0,) * n for n in range(8)}  # a whole tensor's grid strides, shared
    out = {}
    for kd, where in sorted(plain, key=lambda p: (-math.prod(p[0].shape) * p[0].itemsize, p[0].key)):
        nbytes = math.prod(kd.shape) * kd.itemsize
        heap = heaps.get(where)
        if heap is None:
            heap = heaps[where] = sorted((load.get(r, 0), r) for i in where for r in holders[i])
        if kd.lowest or nbytes <= SMALL_CHUNK_BYTES:
            rank = lowest.get(where, -1)
            if rank < 0:
                rank = lowest[where] = min(holders[i][0] for i in where)
        else:
            while heap[0][0] != load.get(heap[0][1], 0):  # another set's choice raised it: refresh
                heapq.heapreplace(heap, (load.get(heap[0][1], 0), heap[0][1]))
            rank = heap[0][1]
        load[rank] = load.get(rank, 0) + nbytes
        if heap[0][1] == rank:
            heapq.heapreplace(heap, (load[rank], rank))
        strides = zeros.get(len(kd.shape)) or (0,) * len(kd.shape)
        out[kd.key] = Placement(kd.key, kd.dtype, kd.shape, Grid(kd.shape, rank, strides))
    return out
