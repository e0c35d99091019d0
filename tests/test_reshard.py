"""Property tests for the resharding math, against torch slicing as the reference."""

from __future__ import annotations

import itertools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stashpoint._core.reshard import Box, block_spans, intersect, local, runs


@st.composite
def box_pairs(draw):
    ndim = draw(st.integers(0, 4))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(ndim))

    def sub():
        offs, sh = [], []
        for n in shape:
            a = draw(st.integers(0, n - 1))
            b = draw(st.integers(a + 1, n))
            offs.append(a)
            sh.append(b - a)
        return Box(tuple(offs), tuple(sh))

    return shape, sub(), sub()


@given(box_pairs(), st.sampled_from([1, 2, 4, 8]))
@settings(max_examples=400, deadline=None)
def test_runs_read_exactly_the_intersection(pair, itemsize):
    shape, chunk, want = pair
    full = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    inter = intersect(chunk, want)
    if inter is None:
        assert any(
            co + cn <= wo or wo + wn <= co
            for co, cn, wo, wn in zip(chunk.offsets, chunk.shape, want.offsets, want.shape)
        )
        return
    # the chunk as stored: row-major bytes of its box, one "element" = itemsize bytes
    chunk_t = full[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.shape))]
    stored = chunk_t.contiguous().reshape(-1).repeat_interleave(itemsize)
    got = torch.cat([stored[b:e] for b, e in runs(chunk, inter, itemsize)]) if inter.numel else stored[:0]
    expected = full[tuple(slice(o, o + n) for o, n in zip(inter.offsets, inter.shape))]
    assert torch.equal(got, expected.contiguous().reshape(-1).repeat_interleave(itemsize))
    ranges = list(runs(chunk, inter, itemsize))
    assert all(a[1] < b[0] for a, b in itertools.pairwise(ranges)), "runs are sorted and merged"
    assert sum(e - b for b, e in ranges) == inter.numel * itemsize, "nothing read beyond what is needed"
    loc = local(inter, chunk)
    assert all(o >= 0 and o + n <= c for o, n, c in zip(loc.offsets, loc.shape, chunk.shape))


@given(st.lists(st.tuples(st.integers(0, 100), st.integers(0, 40)), max_size=6), st.integers(1, 16))
def test_block_spans_cover_every_range_with_whole_blocks(raw, block):
    total = 140
    ranges = sorted((b, min(b + n, total)) for b, n in raw)
    spans = block_spans(ranges, block, total)
    for b, e in ranges:
        if e > b:
            assert any(s <= b and e <= t for s, t in spans)
    for s, t in spans:
        assert s % block == 0 and (t % block == 0 or t == total)
    assert all(a[1] < b[0] for a, b in itertools.pairwise(spans))


def test_examples():
    chunk = Box((0, 0), (4, 6))
    assert list(runs(chunk, Box((1, 0), (2, 6)), 4)) == [(24, 72)]  # whole rows: one run
    assert list(runs(chunk, Box((0, 2), (2, 2)), 1)) == [(2, 4), (8, 10)]  # a column block
    assert intersect(Box((0,), (4,)), Box((4,), (4,))) is None
    assert list(runs(Box((), ()), Box((), ()), 8)) == [(0, 8)]


def test_partial_reads_from_a_real_checkpoint(tmp_path):
    import pytest

    import stashpoint
    from stashpoint._core.format import CHECKSUM_BLOCK_BYTES
    from stashpoint._load.manifest import read_manifest
    from stashpoint._load.reads import execute_reads
    from stashpoint._load.restoreplan import Read
    from stashpoint._storage import LocalStorage

    w = torch.arange(3 * CHECKSUM_BLOCK_BYTES // 4, dtype=torch.float32).reshape(-1, 1024)  # 3 blocks
    stashpoint.save({"w": w}, tmp_path / "ck")
    storage = LocalStorage(tmp_path / "ck")
    manifest = read_manifest(storage)
    for verify in (True, False):
        for region in (Box((5, 100), (7, 300)), Box((1000, 0), (1100, 1024)), Box((0, 0), tuple(w.shape))):
            dest = torch.zeros(region.shape)
            execute_reads(storage, manifest, [Read("w", dest, region)], verify=verify)
            sl = tuple(slice(o, o + n) for o, n in zip(region.offsets, region.shape))
            assert torch.equal(dest, w[sl]), (verify, region)
    # damage the last block: a partial read of the first rows does not need it, one of the last rows does
    (shard,) = (tmp_path / "ck").glob("shard-*")
    data = bytearray(shard.read_bytes())
    data[-5] ^= 1
    shard.write_bytes(bytes(data))
    execute_reads(storage, manifest, [Read("w", torch.zeros(2, 1024), Box((0, 0), (2, 1024)))], verify=True)
    with pytest.raises(stashpoint.CorruptCheckpointError, match="checksum mismatch for key 'w'"):
        execute_reads(storage, manifest, [Read("w", torch.zeros(2, 1024), Box((3070, 0), (2, 1024)))], verify=True)
