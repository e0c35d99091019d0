"""First plans from descriptions (``_core.described``): DTensor grids against torch's own
placement of every coordinate's shard, and plain tensors' writers against the general
assignment."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from stashpoint._core.assign import ChunkMeta, assign_writers
from stashpoint._core.described import Description, KeyDesc, Spread, described_catalog, spread_grid
from stashpoint._core.reshard import Box
from stashpoint.errors import CheckpointError


@st.composite
def spreads(draw):
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    dims = tuple(draw(st.one_of(st.none(), st.integers(0, len(shape) - 1))) for _ in mesh_shape)
    # an affine numbering: row-major or column-major, from some first rank
    base = draw(st.integers(0, 5))
    if draw(st.booleans()) or len(mesh_shape) == 1:
        strides = tuple(math.prod(mesh_shape[k + 1 :]) for k in range(len(mesh_shape)))
    else:
        strides = (1, mesh_shape[0])
    itemsize = draw(st.sampled_from([1, 4, 64]))
    key = draw(st.sampled_from(["a", "model/w", "optim/state/3/exp_avg"]))
    return KeyDesc(key, "float32", shape, itemsize, Spread(mesh_shape, base, strides, dims))


@given(spreads())
@settings(max_examples=300, deadline=None)
def test_a_grid_gives_each_chunk_to_a_rank_that_holds_exactly_it(kd):
    s = kd.spread
    grid = spread_grid(kd)
    sharded = [d for d in s.dims if d is not None]
    if math.prod(kd.shape) == 0 or len(set(sharded)) != len(sharded):
        assert grid is None
        return
    assert grid is not None
    placements = [Replicate() if d is None else Shard(d) for d in s.dims]
    held: dict[int, Box] = {}
    for coord in itertools.product(*(range(n) for n in s.mesh_shape)):
        shape, off = _compute_local_shape_and_global_offset(kd.shape, s.mesh_shape, list(coord), placements)
        rank = s.mesh_base + sum(c * k for c, k in zip(coord, s.mesh_strides))
        held[rank] = Box(tuple(off), tuple(shape))
    counts = grid.counts(kd.shape)
    covered = 0
    for cell in itertools.product(*(range(c) for c in counts)):
        box = Box(
            tuple(i * b for i, b in zip(cell, grid.block)),
            tuple(min(b, n - i * b) for i, b, n in zip(cell, grid.block, kd.shape)),
        )
        writer = grid.writer(cell)
        assert writer in held and held[writer] == box, (cell, writer, held.get(writer), box)
        covered += box.numel
    assert covered == math.prod(kd.shape)
    for rank, box in held.items():  # and what every rank holds is one of the cells
        if box.numel:
            cell = tuple(o // b for o, b in zip(box.offsets, grid.block))
            assert all(o % b == 0 for o, b in zip(box.offsets, grid.block)) and all(
                i < c for i, c in zip(cell, counts)
            ), (rank, box)


def test_replicas_share_the_writing_by_key_and_small_tensors_go_to_the_first():
    spread = Spread((2, 4), 0, (4, 1), (None, 0))  # HSDP: 2 replicas of 4 shards
    bases = {spread_grid(KeyDesc(f"k{i}", "float32", (64, 8), 4, spread)).base for i in range(40)}
    assert bases == {0, 4}, "each replica group writes some of the tensors"
    assert spread_grid(KeyDesc("k1", "float32", (4,), 4, spread)).base == 0  # 4 bytes per chunk: small
    assert spread_grid(KeyDesc("k1", "float32", (64, 8), 4, spread, lowest=True)).base == 0


@st.composite
def plain_worlds(draw):
    world = draw(st.integers(1, 7))
    ndesc = draw(st.integers(1, min(3, world)))
    members = draw(st.lists(st.integers(0, ndesc - 1), min_size=world, max_size=world))
    keys = [f"k{i}" for i in range(draw(st.integers(1, 12)))]
    descs = []
    for _ in range(ndesc):
        mine = draw(st.lists(st.sampled_from(keys), unique=True, max_size=len(keys)))
        descs.append(
            Description(
                tuple(KeyDesc(k, "float32", (int(k[1:]) * 37 % 50,), 4, None, k == "k3") for k in sorted(mine)), ()
            )
        )
    return descs, members


@given(plain_worlds())
@settings(max_examples=200, deadline=None)
def test_plain_tensors_get_the_writers_the_general_assignment_gives(world):
    descs, members = world
    plan = described_catalog(descs, members)
    assert plan is not None
    catalog = plan.catalog
    per_rank = [
        [ChunkMeta(k.key, k.dtype, k.shape, (0,), k.shape, k.itemsize, k.lowest) for k in descs[i].keys]
        for i in members
    ]
    general = assign_writers(per_rank)
    assert {i[0] for i in general} == set(catalog)
    for (key, _, shape), rank in general.items():
        p = catalog[key]
        if math.prod(shape) == 0:  # no bytes: no cell in the catalog, the same writer for its empty chunk
            assert p.grid is None and p.cells == () and plan.writes(key, (0,), shape, rank)
        else:
            assert p.grid is not None and p.grid.base == rank, (key, rank, p)


def test_disagreements_are_named_and_mixed_spreads_take_the_general_path():
    spread = Spread((2,), 0, (1,), (0,))
    a = Description((KeyDesc("w", "float32", (4, 4), 4, spread),), ())
    b = Description((KeyDesc("w", "bfloat16", (4, 4), 2, spread),), ())
    with pytest.raises(CheckpointError, match=r"'w' is float32\[4, 4\] on rank 0 but bfloat16\[4, 4\] on rank 1"):
        described_catalog([a, b], [0, 1])
    plain = Description((KeyDesc("w", "float32", (4, 4), 4, None),), ())
    assert described_catalog([a, plain], [0, 1]) is None
    strided = Description((KeyDesc("w", "float32", (4, 4), 4, Spread((2, 2), 0, (2, 1), (0, 0))),), ())
    assert described_catalog([strided], [0, 0, 0, 0]) is None


def test_a_mesh_rank_without_the_tensor_or_outside_the_world_takes_the_general_path():
    spread = Spread((4,), 0, (1,), (0,))
    w = KeyDesc("w", "float32", (8, 2), 4, spread)
    full, short = Description((w,), ()), Description((), ())
    assert described_catalog([full], [0, 0, 0, 0]) is not None
    assert described_catalog([full, short], [0, 0, 0, 1]) is None  # rank 3 would write a chunk it lacks
    assert described_catalog([full], [0, 0, 0]) is None  # rank 3 is not in the world


def test_aliases_and_empty_tensors():
    d = Description(
        (KeyDesc("w", "float32", (4,), 4, None), KeyDesc("e", "float32", (0, 3), 4, None)), (("tied", "w"),)
    )
    plan = described_catalog([d], [0, 0])
    assert plan is not None
    catalog = plan.catalog
    assert catalog["tied"].alias_of == "w" and catalog["tied"].shape == (4,)
    assert catalog["e"].grid is None and catalog["e"].cells == ()
    # the empty tensor's chunk is written once (by its lowest holder), as the general plan does
    assert plan.writes("e", (0, 0), (0, 3), 0) and not plan.writes("e", (0, 0), (0, 3), 1)
    dangling = Description((KeyDesc("w", "float32", (4,), 4, None),), (("tied", "gone"),))
    assert described_catalog([dangling], [0]) is None


def test_a_described_plan_at_scale_is_one_grid_per_tensor():
    world, tensors = 4096, 200
    spread = Spread((world,), 0, (1,), (0,))
    d = Description(tuple(KeyDesc(f"p{i}", "float32", (world * 3 + i, 16), 4, spread) for i in range(tensors)), ())
    plan = described_catalog([d], [0] * world)
    assert plan is not None
    catalog = plan.catalog
    assert all(p.grid is not None and p.grid.strides == (1, 0) for p in catalog.values())
    assert torch.Size(catalog["p1"].grid.block) == torch.Size([4, 16])
