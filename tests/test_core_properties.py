"""Property tests of the pure core (``stashpoint._core``), with no torch and no processes.

Covered: ``assign_writers`` (one copying holder per chunk, buffers to the lowest holder, replicas
balanced within the largest chunk, independent of chunk order, disagreements named);
``assign_readers`` (one reader each, within a share, few readers, order-independent);
``merge_trees`` (distinct by serialized form, not by ``==``); the naming round trips and their
near misses; the dtype tables; and manifests built from random grids of chunks laid out by
``plan_files``, which survive ``to_json`` -> ``parse_manifest`` unchanged and are refused once a
chunk is dropped, moved onto another chunk's bytes or shifted onto a neighbour.
The last test checks that importing every ``stashpoint._core`` module loads no torch.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import math
import random
import subprocess
import sys

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from stashpoint._core.assign import (
    READ_SHARE_FLOOR,
    SMALL_CHUNK_BYTES,
    ChunkMeta,
    assign_readers,
    assign_writers,
    merge_trees,
)
from stashpoint._core.dtypes import ITEMSIZE, SAFETENSORS, itemsize, safetensors_view
from stashpoint._core.format import CHECKSUM_BLOCK_BYTES, Chunk, FileEntry, Manifest, TensorEntry, parse_manifest
from stashpoint._core.naming import is_set_aside, parse_shard_name, parse_step_dir, set_aside_name, shard_name, step_dir
from stashpoint._core.plan import TensorSpec, plan_files
from stashpoint._core.reshard import Box, block_count
from stashpoint.errors import CheckpointError, CorruptCheckpointError

FAST = settings(max_examples=150, deadline=None)
DTYPES = sorted(ITEMSIZE)
keys_st = st.text(min_size=1, max_size=8)


def _grid(shape: tuple[int, ...], cuts: list[list[int]]) -> list[Box]:
    """The boxes of ``shape`` cut along each dimension at ``cuts[d]`` (row-major order)."""
    per_dim = []
    for n, cs in zip(shape, cuts):
        edges = [0, *sorted(set(cs)), n]
        per_dim.append([(a, b - a) for a, b in itertools.pairwise(edges)])
    return [Box(tuple(o for o, _ in p), tuple(k for _, k in p)) for p in itertools.product(*per_dim)]


@st.composite
def grids(draw, max_dim: int = 5):
    """A global shape (up to 3 dims, maybe with a zero dimension) and its chunks as a grid."""
    shape = tuple(draw(st.lists(st.integers(0, max_dim), max_size=3)))
    cuts = [draw(st.lists(st.integers(1, n - 1), max_size=n - 1)) if n > 1 else [] for n in shape]
    return shape, _grid(shape, cuts)


# -- assign_writers --------------------------------------------------------------------------------


@st.composite
def layouts(draw):
    """Per rank, the chunks it holds (each key's grid pieces spread over random holders), with
    consistent metadata; and per rank what it copied (None: everything)."""
    world = draw(st.integers(1, 5))
    per_rank: list[list[ChunkMeta]] = [[] for _ in range(world)]
    for key in draw(st.lists(keys_st, min_size=1, max_size=5, unique=True)):
        dtype, lowest = draw(st.sampled_from(DTYPES)), draw(st.booleans())
        shape, boxes = draw(grids())
        for box in boxes:
            c = ChunkMeta(key, dtype, shape, box.offsets, box.shape, ITEMSIZE[dtype], lowest)
            for r in draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=world, unique=True)):
                per_rank[r].append(c)
    copied = [st.none() | st.sets(st.sampled_from([c.ident for c in cs] or [None])) for cs in per_rank]
    staged = draw(st.none() | st.tuples(*copied))
    return per_rank, staged


def _holders(per_rank, staged=None) -> dict:
    out: dict = {}
    for r, chunks in enumerate(per_rank):
        for c in chunks:
            copied = staged is None or staged[r] is None or c.ident in staged[r]
            out.setdefault(c.ident, (c, []))[1].extend([r] if copied else [])
    return out


@FAST
@given(layouts(), st.randoms(use_true_random=False))
def test_every_chunk_has_one_writer_that_copied_it_in_any_chunk_order(layout, rnd):
    per_rank, staged = layout
    holders = _holders(per_rank, staged)
    if any(not ranks for _, ranks in holders.values()):
        with pytest.raises(CheckpointError, match="no rank copied"):
            assign_writers(per_rank, staged)
        return
    writers = assign_writers(per_rank, staged)
    assert writers.keys() == holders.keys()
    for ident, (chunk, ranks) in holders.items():
        assert writers[ident] in ranks
        if chunk.lowest:
            assert writers[ident] == min(ranks)
    shuffled = [rnd.sample(cs, len(cs)) for cs in per_rank]  # every rank computes it alone: must agree
    assert assign_writers(shuffled, staged) == writers


@FAST
@given(st.integers(1, 8), st.lists(st.tuples(st.integers(0, 1000), st.sampled_from(DTYPES)), min_size=1, max_size=30))
def test_replicated_bytes_are_balanced_within_the_largest_chunk(world, sizes):
    """Small chunks (scalars) go to the lowest holder, so that loads read one index for them; the
    others are balanced."""
    chunks = [ChunkMeta(f"k{i}", d, (n * 10,), (0,), (n * 10,), ITEMSIZE[d]) for i, (n, d) in enumerate(sizes)]
    writers = assign_writers([random.Random(r).sample(chunks, len(chunks)) for r in range(world)])
    load = [0] * world
    for c in chunks:
        if c.nbytes <= SMALL_CHUNK_BYTES:
            assert writers[c.ident] == 0
        else:
            load[writers[c.ident]] += c.nbytes
    largest = max(c.nbytes for c in chunks)
    mean = sum(load) / world
    assert all(abs(x - mean) <= largest for x in load), (load, largest)
    assert max(load) - min(load) <= largest


@FAST
@given(layouts(), st.data())
def test_ranks_disagreeing_on_a_key_raise_naming_it(layout, data):
    per_rank, _ = layout
    assume(len(per_rank) > 1)
    r = data.draw(st.integers(1, len(per_rank) - 1))
    c = data.draw(st.sampled_from([c for cs in per_rank for c in cs]))
    if data.draw(st.booleans()):
        bad = ChunkMeta(c.key, next(d for d in DTYPES if d != c.dtype), c.global_shape, c.offsets, c.shape, 4)
    else:
        bad = ChunkMeta(c.key, c.dtype, (*c.global_shape, 1), (*c.offsets, 0), (*c.shape, 1), c.itemsize)
    per_rank[r].insert(data.draw(st.integers(0, len(per_rank[r]))), bad)
    with pytest.raises(CheckpointError, match="disagree") as e:
        assign_writers(per_rank)
    assert repr(c.key) in str(e.value)


# -- assign_readers --------------------------------------------------------------------------------


@FAST
@given(
    st.dictionaries(
        st.tuples(keys_st, st.builds(Box, st.tuples(st.integers(0, 9)), st.tuples(st.integers(0, 9)))),
        st.integers(0, 10_000),
        max_size=25,
    ),
    st.integers(1, 5),
    st.sampled_from([0, 1, 5_000, 1 << 30]),
    st.randoms(use_true_random=False),
)
def test_readers_each_item_once_within_a_share_in_any_order(wanted, world, floor, rnd):
    out = assign_readers(wanted, world, floor)
    assert out.keys() == wanted.keys()
    assert all(0 <= r < world for r in out.values())
    load = [0] * world
    for item, r in out.items():
        load[r] += wanted[item]
    total = sum(wanted.values())
    readers = max(1, min(world, -(-total // max(1, floor))))
    largest = max(wanted.values(), default=0)
    assert max(load) <= -(-total // readers) + largest, (load, readers, largest)
    assert set(out.values()) <= set(range(readers)), "the first k ranks read"
    if floor >= total:
        assert set(out.values()) <= {0}, "a state under the floor: one reader, one broadcast"
    assert assign_readers(dict(rnd.sample(list(wanted.items()), len(wanted))), world, floor) == out


def test_readers_at_sixteen_thousand_ranks_take_no_time_and_few_broadcasts():
    """1,000 small tensors (Adam's step counters) and 3,000 of 1 MiB, at 16,384 ranks: quick,
    and as many readers as 64 MiB shares (each tensor went to a rank of its own)."""
    import time

    small = {(f"optim/state/{i}/step", Box((), ())): 8 for i in range(1000)}
    big = {(f"model/w{i}", Box((0,), (1 << 18,))): 1 << 20 for i in range(3000)}
    t0 = time.perf_counter()
    out = assign_readers({**small, **big}, 16_384)
    assert time.perf_counter() - t0 < 1.0
    assert len(set(out.values())) <= -(-(3000 << 20) // READ_SHARE_FLOOR) + 1
    assert set(assign_readers(small, 16_384).values()) == {0}, "the counters alone: one broadcast"


# -- merge_trees -----------------------------------------------------------------------------------

leaves = st.none() | st.booleans() | st.integers() | st.floats() | st.text()
json_trees = st.recursive(
    leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
)


def _twin(t):
    """A tree == to ``t`` that must be saved apart from it: True as 1, 1 as 1.0, 0.0 as -0.0."""
    if isinstance(t, dict):
        return {k: _twin(v) for k, v in t.items()}
    if isinstance(t, list):
        return [_twin(v) for v in t]
    if isinstance(t, bool):
        return int(t)
    if isinstance(t, int) and abs(t) < 2**53:
        return float(t)
    return -t if isinstance(t, float) and t == 0 else t


@FAST
@given(st.lists(json_trees, min_size=1, max_size=3).map(lambda ts: ts + [_twin(t) for t in ts]), st.data())
def test_merge_trees_stores_each_distinct_tree_once(pool, data):
    inputs = [copy.deepcopy(data.draw(st.sampled_from(pool))) for _ in range(data.draw(st.integers(1, 8)))]
    trees, of_rank = merge_trees(inputs)
    assert len(of_rank) == len(inputs)
    assert [repr(trees[i]) for i in of_rank] == [repr(t) for t in inputs]
    assert len(trees) == len({repr(t) for t in inputs})
    for a, b in itertools.combinations(range(len(inputs)), 2):
        assert (of_rank[a] == of_rank[b]) == (repr(inputs[a]) == repr(inputs[b]))
    first_seen = list(dict.fromkeys(of_rank))
    assert first_seen == list(range(len(trees)))  # indices in order of first appearance


def test_merge_trees_keeps_equal_but_different_values_apart():
    trees, of_rank = merge_trees([{"value": 1}, {"value": True}, {"value": 1.0}, {"value": -0.0}, {"value": 1}])
    assert len(trees) == 4 and of_rank == (0, 1, 2, 3, 0)


# -- naming ----------------------------------------------------------------------------------------

ARABIC_INDIC = {str(d): chr(0x660 + d) for d in range(10)}
hex_ids = st.text(alphabet="0123456789abcdef", min_size=1, max_size=32)


def _near_misses(name: str, digits_at: int) -> list[str]:
    """Names one edit away from ``name`` that no writer produces."""
    head, tail = name[:digits_at], name[digits_at:]
    d = tail[0]
    return [
        head + "0" + tail,  # extra padding
        head + ARABIC_INDIC[d] + tail[1:],  # a non-ASCII digit
        head + chr(0xFF10 + int(d)) + tail[1:],  # a fullwidth digit
        name + "\n",
        " " + name,
        name + ".tmp",
        "x" + name,
        name.upper(),
        head + "+" + tail,
    ]


@FAST
@given(st.integers(0, 10**7), st.integers(0, 10**6), hex_ids)
def test_shard_names_round_trip_and_near_misses_are_refused(rank, index, save_id):
    name = shard_name(rank, index, save_id)
    assert parse_shard_name(name) == (rank, index, save_id)
    for bad in _near_misses(name, len("shard-r")):
        assert parse_shard_name(bad) is None, bad
    assert parse_shard_name(name.replace(f"-{index:04d}-", f"-0{index:04d}-")) is None


@FAST
@given(st.integers(0, 10**12))
def test_step_dirs_near_misses_are_refused(step):
    name = step_dir(step)
    assert parse_step_dir(name) == step
    for bad in _near_misses(name, len("step-")):
        assert parse_step_dir(bad) is None, bad


@FAST
@given(
    st.integers(0, 10**12),
    st.datetimes(min_value=datetime.datetime(1000, 1, 1)),  # %Y pads no year < 1000
    st.integers(0, 9999),
)
def test_set_aside_names_are_recognised(step, when, n):
    name = set_aside_name(step, when.strftime("%Y%m%d-%H%M%S"), "rewound" if n % 2 else "damaged", n)
    assert is_set_aside(name)
    assert parse_step_dir(name) is None  # never taken for a step
    assert not is_set_aside(step_dir(step))
    assert not is_set_aside(name + "\n")
    if n == 0:
        assert is_set_aside(name + "-1")
    else:
        assert not is_set_aside(name + "-1")
    if n < 10:  # a longer counter cut short is a shorter one
        assert not is_set_aside(name[:-1])
    assert not is_set_aside("step-0" + name[len("step-") :])


# -- dtypes ----------------------------------------------------------------------------------------

ST_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
ST_SIZES |= {"C64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1, "U16": 2, "U32": 4, "U64": 8}


@pytest.mark.parametrize("name", DTYPES)
def test_itemsize_of_every_dtype_and_its_safetensors_name(name):
    assert itemsize(name, "x") == ITEMSIZE[name] >= 1
    if name in SAFETENSORS:
        assert ST_SIZES[SAFETENSORS[name]] == ITEMSIZE[name]  # a safetensors reader sees the same bytes


@FAST
@given(st.sampled_from(DTYPES), st.lists(st.integers(0, 50), max_size=4))
def test_safetensors_view(name, shape):
    nbytes = math.prod(shape) * ITEMSIZE[name]
    st_dtype, st_shape = safetensors_view(name, shape, nbytes)
    if name in SAFETENSORS:
        assert (st_dtype, st_shape) == (SAFETENSORS[name], list(shape))
    else:
        assert (st_dtype, st_shape) == ("U8", [nbytes])
    assert math.prod(st_shape) * ST_SIZES[st_dtype] == nbytes


@FAST
@given(st.text().filter(lambda s: s not in ITEMSIZE) | st.integers() | st.none() | st.lists(st.text(), max_size=1))
def test_unknown_dtypes_are_corruption(name):
    with pytest.raises(CorruptCheckpointError, match="unknown dtype"):
        itemsize(name, "where")


# -- plan_files -> Manifest -> to_json -> parse_manifest -------------------------------------------

DATA_START = 4096


@st.composite
def manifests(draw):
    """A manifest of random grid-chunked tensors (and aliases), the chunks spread over ranks and
    laid out by ``plan_files`` into shard files; the trees merged with ``merge_trees``."""
    world, save_id = draw(st.integers(1, 3)), draw(hex_ids)
    tensors: dict[str, list] = {}
    specs: list[list[TensorSpec]] = [[] for _ in range(world)]
    for key in draw(st.lists(keys_st, min_size=1, max_size=4, unique=True)):
        dtype, (shape, boxes) = draw(st.sampled_from(DTYPES)), draw(grids())
        tensors[key] = [dtype, shape, []]
        for box in draw(st.permutations(boxes)):
            tensors[key][2].append(box)
            spec_key = repr((key, box.offsets))
            specs[draw(st.integers(0, world - 1))].append(TensorSpec(spec_key, dtype, box.shape, ITEMSIZE[dtype]))
    files, where = [], {}
    limit = draw(st.integers(1, 600))
    for r in range(world):
        for f in plan_files(specs[r], max_file_bytes=limit, rank=r).files:
            name = shard_name(r, f.index, save_id)
            files.append(FileEntry(name, DATA_START + f.data_size, DATA_START, "0" * 16, r))
            where.update({p.key: (name, DATA_START + p.begin, DATA_START + p.end) for p in f.placements})
    entries = {}
    for key, (dtype, shape, boxes) in tensors.items():
        chunks = []
        for b in boxes:
            name, start, end = where[repr((key, b.offsets))]
            sums = ("0" * 16,) * block_count(end - start, CHECKSUM_BLOCK_BYTES)
            chunks.append(Chunk(name, b.offsets, b.shape, start, end, sums))
        entries[key] = TensorEntry(key, dtype, shape, tuple(chunks))
    for alias in draw(st.lists(keys_st.filter(lambda k: k not in tensors), max_size=2, unique=True)):
        target = entries[draw(st.sampled_from(sorted(tensors)))]
        entries[alias] = TensorEntry(alias, target.dtype, target.shape, alias_of=target.key)
    keys = draw(st.permutations(sorted(entries)))
    per_rank = [{"dict": [[k, {"tensor": k}] for k in keys] + [["step", {"value": r % 2}]]} for r in range(world)]
    trees, of_rank = merge_trees(per_rank)
    metadata = draw(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3))
    ordered = {k: entries[k] for k in keys}
    return Manifest(save_id, "2024-01-01T00:00:00Z", "0", "0", tuple(files), ordered, trees, metadata, world, of_rank)


def _with_chunks(m: Manifest, key: str, chunks: list[Chunk]) -> Manifest:
    e = m.tensors[key]
    return Manifest(**{**vars(m), "tensors": {**m.tensors, key: TensorEntry(key, e.dtype, e.shape, tuple(chunks))}})


def _nonempty(m: Manifest) -> list[tuple[str, int]]:
    return [(k, i) for k, e in m.tensors.items() for i, c in enumerate(e.chunks) if c.end > c.start]


@settings(max_examples=200, deadline=None)
@given(manifests())
def test_a_manifest_survives_json_unchanged(m):
    raw = m.to_json()
    back = parse_manifest(raw, "x")
    assert back == m
    assert back.to_json() == raw


@FAST
@given(manifests(), st.data())
def test_a_manifest_missing_a_chunk_is_refused(m, data):
    assume(_nonempty(m))
    key, i = data.draw(st.sampled_from(_nonempty(m)))
    chunks = list(m.tensors[key].chunks)
    del chunks[i]
    with pytest.raises(CorruptCheckpointError, match=r"elements|no chunks"):
        parse_manifest(_with_chunks(m, key, chunks).to_json(), "x")


@FAST
@given(manifests(), st.data())
def test_a_chunk_moved_onto_another_chunks_bytes_is_refused(m, data):
    by_file: dict = {}
    for key, i in _nonempty(m):
        by_file.setdefault(m.tensors[key].chunks[i].file, []).append((key, i))
    crowded = [v for v in by_file.values() if len(v) > 1]
    assume(crowded)
    (ka, ia), (kb, ib) = data.draw(st.permutations(data.draw(st.sampled_from(crowded))))[:2]
    a, b = m.tensors[ka].chunks[ia], m.tensors[kb].chunks[ib]
    size = next(f.size for f in m.files if f.name == a.file)
    start = min(b.start, size - (a.end - a.start))  # inside the file, overlapping b
    chunks = list(m.tensors[ka].chunks)
    chunks[ia] = Chunk(a.file, a.offsets, a.shape, start, start + a.end - a.start, a.checksums)
    with pytest.raises(CorruptCheckpointError, match="share bytes"):
        parse_manifest(_with_chunks(m, ka, chunks).to_json(), "x")


@FAST
@given(manifests(), st.data())
def test_a_chunk_shifted_onto_its_neighbour_is_refused(m, data):
    tiled = [k for k, e in m.tensors.items() if sum(c.end > c.start for c in e.chunks) > 1]
    assume(tiled)
    key = data.draw(st.sampled_from(tiled))
    e = m.tensors[key]
    i = data.draw(st.sampled_from([i for i, c in enumerate(e.chunks) if c.end > c.start]))
    c = e.chunks[i]
    d = data.draw(st.sampled_from([d for d, (k, n) in enumerate(zip(c.shape, e.shape)) if k < n]))
    room = range(-c.offsets[d], e.shape[d] - c.offsets[d] - c.shape[d] + 1)
    shift = data.draw(st.sampled_from([s for s in room if s]))
    offsets = tuple(o + shift if j == d else o for j, o in enumerate(c.offsets))
    chunks = list(e.chunks)
    chunks[i] = Chunk(c.file, offsets, c.shape, c.start, c.end, c.checksums)
    with pytest.raises(CorruptCheckpointError, match=r"overlap|grid"):
        parse_manifest(_with_chunks(m, key, chunks).to_json(), "x")


def test_the_core_imports_no_torch():
    code = (
        "import importlib, pkgutil, sys; import stashpoint._core as core; "
        "names = [m.name for m in pkgutil.iter_modules(core.__path__)]; "
        "[importlib.import_module('stashpoint._core.' + n) for n in names]; "
        "assert {'assign', 'naming', 'dtypes', 'plan', 'reshard', 'policy', 'format'} <= set(names), names; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
