"""Who writes each chunk of a distributed save (``_dist.assign_writers``), as a pure function."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from stashpoint._core.assign import ChunkMeta, assign_writers


@st.composite
def layouts(draw):
    ranks = draw(st.integers(1, 5))
    keys = draw(st.lists(st.tuples(st.integers(1, 64), st.booleans()), min_size=1, max_size=12))
    per_rank: list[list[ChunkMeta]] = [[] for _ in range(ranks)]
    for i, (rows, lowest) in enumerate(keys):
        holders = draw(st.lists(st.integers(0, ranks - 1), min_size=1, max_size=ranks, unique=True))
        for r in holders:
            per_rank[r].append(ChunkMeta(f"k{i}", "F32", (rows,), (0,), (rows,), 4, lowest))
    return per_rank


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_every_chunk_goes_to_one_of_its_holders_and_buffers_to_the_lowest(per_rank):
    writers = assign_writers(per_rank)
    holders: dict = {}
    for r, chunks in enumerate(per_rank):
        for c in chunks:
            holders.setdefault(c.ident, (c, []))[1].append(r)
    assert writers.keys() == holders.keys()
    for ident, (chunk, ranks) in holders.items():
        assert writers[ident] in ranks
        if chunk.lowest:
            assert writers[ident] == min(ranks)


def test_replicas_are_spread_over_the_ranks_that_hold_them():
    chunks = [ChunkMeta(f"k{i}", "F32", (2000,), (0,), (2000,), 4) for i in range(8)]  # over SMALL_CHUNK_BYTES
    writers = assign_writers([chunks, chunks])
    assert sorted(list(writers.values()).count(r) for r in (0, 1)) == [4, 4]
    buffers = [ChunkMeta(f"b{i}", "F32", (100,), (0,), (100,), 4, True) for i in range(4)]
    writers = assign_writers([buffers, buffers])
    assert set(writers.values()) == {0}
