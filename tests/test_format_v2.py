"""Format version 2: per-rank indexes beside the data, a small manifest with the catalog.

Grids are checked against brute force; a hostile manifest or index (re-sealed, so that its
checksum matches) raises only CheckpointError, through loads and every tool; version-1
checkpoints still load."""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import stashpoint
from conftest import index_doc, reseal_index, to_v1
from stashpoint._core.catalog import Grid, Placement, compact, placement
from stashpoint._core.format import seal
from stashpoint._core.index import parse_head
from stashpoint._core.naming import MANIFEST_NAME
from stashpoint._core.reshard import Box, intersect
from stashpoint._core.sealed import checksum
from stashpoint.errors import CheckpointError, CorruptCheckpointError
from test_format import _paths, json_values

# -- the catalog's grids ---------------------------------------------------------------------


def _even(shape, parts, order):
    """Chunks of ``shape`` split evenly (torch.chunk sizes) into ``parts`` per dimension, each
    written by the rank its cell has in ``order`` (a permutation of the axes' strides)."""
    blocks = [-(-n // p) for n, p in zip(shape, parts)]
    counts = [-(-n // b) for n, b in zip(shape, blocks)]
    strides = [math.prod(counts[d + 1 :]) for d in range(len(counts))]
    strides = [strides[i] for i in order]
    cells = []
    for cell in itertools.product(*(range(c) for c in counts)):
        off = tuple(i * b for i, b in zip(cell, blocks))
        shp = tuple(min(b, n - o) for b, n, o in zip(blocks, shape, off))
        cells.append((off, shp, sum(s * i for s, i in zip(strides, cell))))
    return cells


@given(
    st.lists(st.integers(1, 9), min_size=0, max_size=3).flatmap(
        lambda shape: st.tuples(
            st.just(tuple(shape)),
            st.tuples(*(st.integers(1, n) for n in shape)),
            st.permutations(range(len(shape))),
        )
    ),
    st.data(),
)
@settings(max_examples=200, deadline=None)
def test_even_layouts_compact_to_grids_whose_chunks_and_overlaps_match_brute_force(case, data):
    shape, parts, order = case
    cells = _even(shape, parts, order)
    grid = compact(shape, cells)
    assert grid is not None
    p = Placement("k", "float32", shape, grid)
    for off, shp, writer in cells:
        assert p.expects(Box(off, shp), writer)
        assert not p.expects(Box(off, shp), writer + 1)
    lo = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    region = Box(lo, tuple(data.draw(st.integers(1, n - o)) for n, o in zip(shape, lo)))
    want = sorted((off, shp, w) for off, shp, w in cells if intersect(Box(off, shp), region) is not None)
    got = sorted((b.offsets, b.shape, w) for b, w in p.overlapping(region))
    assert got == want


def test_irregular_layouts_keep_every_chunk_and_empty_chunks_are_dropped():
    cells = [((0,), (3,), 0), ((3,), (2,), 1), ((5,), (5,), 2), ((10,), (0,), 3)]
    assert compact((10,), cells) is None
    p = placement("k", "float32", (10,), cells)
    assert p.grid is None and len(p.cells) == 3
    assert [w for _, w in p.overlapping(Box((4,), (2,)))] == [1, 2]
    fsdp = [((0,), (1,), 0), ((1,), (1,), 1), ((2,), (0,), 2), ((2,), (0,), 3)]  # 2 rows on 4 ranks
    assert placement("k", "float32", (2,), fsdp).grid == Grid((1,), 0, (1,))


# -- hostile manifests and indexes -------------------------------------------------------------


def _state():
    return {"a": torch.ones(3), "m": torch.nn.Linear(2, 2), "b": {"c": [1, 2.5, "x"]}, "step": 7}


def test_a_version_1_checkpoint_still_loads_and_every_tool_reads_it(tmp_path):
    src = _state()
    stashpoint.save(src, tmp_path / "ck")
    to_v1(tmp_path / "ck")
    assert json.loads((tmp_path / "ck" / MANIFEST_NAME).read_bytes())["format_version"] == 1
    out = {"a": torch.zeros(3), "m": torch.nn.Linear(2, 2), "b": {}, "step": 0}
    stashpoint.load(out, tmp_path / "ck")
    assert torch.equal(out["m"].weight, src["m"].weight) and out["step"] == 7 and out["b"] == {"c": [1, 2.5, "x"]}
    assert stashpoint.verify(tmp_path / "ck").ok
    assert torch.equal(stashpoint.read(tmp_path / "ck")["a"], torch.ones(3))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["indexes"].append([10, "0"]), "one index per rank"),
        (lambda d: d["tensors"]["a"].update(grid={"block": [3], "base": 5, "strides": [1]}), "outside the world"),
        (lambda d: d["tensors"]["a"].update(grid={"block": [0], "base": 0, "strides": [0]}), "empty block"),
        (lambda d: d["tensors"]["a"].pop("grid"), "neither a grid nor chunks"),
        (lambda d: d["tensors"]["a"].update(chunks=[[[0], [2], 0]]), "hold 2 elements"),
        (lambda d: d["tensors"]["a"].update(dtype="evil"), "unknown dtype"),
        (lambda d: d["tensors"]["a"].update(alias_of="nope"), "aliases a missing entry"),
        (lambda d: d.update(save_id="/../../etc/x"), "save_id must be 1 to 64 hex digits"),
        (lambda d: d.update(ranks_per_dir=-1), "ranks_per_dir must be an int"),
        (lambda d: d.update(checksum_block_bytes=4194304.0), "unsupported checksum_block_bytes"),
        (lambda d: d["tensors"]["a"].update(grid={"block": [1], "base": 0, "strides": [0]}), "3 cells, more than"),
        (lambda d: d["tensors"]["a"].update(shape=[2**61, 2**61, 0]), "more bytes than a tensor can"),
        (lambda d: d["tensors"]["a"].update(chunks=[[[0], [1], 0], [[1], [2], 0]]), "gives a rank two chunks"),
    ],
)
def test_manifest_validation_names_the_problem(tmp_path, mutate, message):
    stashpoint.save(_state(), tmp_path / "ck")
    doc = json.loads((tmp_path / "ck" / MANIFEST_NAME).read_bytes())
    if message in ("hold 2 elements", "gives a rank two chunks"):
        doc["tensors"]["a"].pop("grid")
    mutate(doc)
    with pytest.raises(CorruptCheckpointError, match=message):
        parse_head(seal(doc), "x")


@pytest.mark.parametrize("odd", [None, float("nan"), float("inf")])
def test_a_manifest_or_index_without_a_seal_is_refused(tmp_path, odd):
    """Before: with no checksum field, a document holding a number JSON has no form for (NaN)
    had no checksum either (None equal to None): edited freely, it loaded."""
    stashpoint.save(_state(), tmp_path / "ck")
    path, doc = index_doc(tmp_path / "ck")
    doc.pop("checksum", None)
    doc["junk"] = odd
    head = json.loads((tmp_path / "ck" / MANIFEST_NAME).read_bytes())
    head.pop("checksum")
    head["junk"] = odd
    raw = json.dumps(doc).encode()
    head["indexes"][0] = [len(raw), checksum(raw)]
    path.write_bytes(raw)
    (tmp_path / "ck" / MANIFEST_NAME).write_text(json.dumps(head))
    with pytest.raises(CorruptCheckpointError, match="checksum does not match its contents"):
        stashpoint.load({"a": torch.zeros(3), "m": torch.nn.Linear(2, 2), "b": {}, "step": 0}, tmp_path / "ck")
    with pytest.raises(CorruptCheckpointError, match="checksum does not match its contents"):
        parse_head(json.dumps(head).encode(), "x")


def test_a_catalog_entry_no_index_holds_is_named_by_verify_and_too_large_to_allocate_is_an_error(tmp_path):
    """Before: a re-sealed catalog entry of 2**40 floats (here 2**59), held by no index, crashed read() and a
    fresh optimizer's load with torch's RuntimeError, and verify said the checkpoint was fine."""
    stashpoint.save(_state(), tmp_path / "ck")
    doc = json.loads((tmp_path / "ck" / MANIFEST_NAME).read_bytes())
    grid = {"block": [2**59], "base": 0, "strides": [0]}  # 2**61 bytes: past any address space
    doc["tensors"]["huge"] = {"dtype": "float32", "shape": [2**59], "grid": grid}
    (tmp_path / "ck" / MANIFEST_NAME).write_bytes(seal(doc))
    path, index = index_doc(tmp_path / "ck")
    index["tree"]["dict"].append(["huge", {"tensor": "huge"}])
    reseal_index(tmp_path / "ck", path, index)
    with pytest.raises(CheckpointError, match=r"cannot allocate 2,305,843,009,213,693,952 bytes for 'huge'"):
        stashpoint.read(tmp_path / "ck")
    report = stashpoint.verify(tmp_path / "ck")
    assert not report.ok and f"the chunks of 'huge' hold 0 of its {2**59} elements" in report.problems[0]


def test_verify_names_a_plain_value_that_does_not_decode(tmp_path):
    stashpoint.save(_state(), tmp_path / "ck")
    path, doc = index_doc(tmp_path / "ck")
    doc["tree"]["dict"].append(["blob", {"bytes": "!!"}])
    reseal_index(tmp_path / "ck", path, doc)
    report = stashpoint.verify(tmp_path / "ck")
    assert not report.ok and "the value at 'blob' does not decode" in " ".join(report.problems), report


def test_the_catalogs_cap_on_chunks_grows_with_the_world(tmp_path):
    """FSDP2 over 16,384 ranks with 1,512 parameters and AdamW: 74M chunks in the catalog, which
    a fixed cap of 2**26 refused (a review's finding); past 65,536 per rank it is refused."""
    stashpoint.save(_state(), tmp_path / "ck")
    doc = json.loads((tmp_path / "ck" / MANIFEST_NAME).read_bytes())
    world = 16384
    doc["world_size"], doc["indexes"] = world, [[100, "0"]] * world
    row = {"dtype": "float32", "shape": [world, 8], "grid": {"block": [1, 8], "base": 0, "strides": [1, 0]}}
    doc["tensors"] = {f"t{i}": row for i in range(1512 * 3)}
    assert len(parse_head(seal(doc), "x").catalog) == 1512 * 3
    doc["world_size"], doc["indexes"] = 64, [[100, "0"]] * 64  # the same 4,536 tensors on 64 ranks fit too
    doc["tensors"] = {k: {**v, "shape": [64, 8]} for k, v in doc["tensors"].items()}
    assert len(parse_head(seal(doc), "x").catalog) == 1512 * 3
    doc["tensors"] = {f"t{i}": {**row, "shape": [64, 8]} for i in range((1 << 16) + 1)}
    with pytest.raises(CorruptCheckpointError, match="the cap at this world size is"):
        parse_head(seal(doc), "x")


def _share(bias, a):
    """Point the 2-element chunk ``bias`` at the first bytes of ``a`` (same file)."""
    bias[0], bias[3], bias[4] = a[0], a[3], a[3] + 8


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(rank=1), "another save's or rank's"),
        (lambda d: d.update(save_id="00"), "another save's or rank's"),
        (lambda d: d.update(rank=False), "another save's or rank's"),
        (lambda d: d["files"][0].__setitem__(0, "../evil"), "points outside the checkpoint"),
        (lambda d: d["files"][0].__setitem__(0, "sub/x"), "points outside the checkpoint"),
        (lambda d: d["files"][0].__setitem__(0, "g00001/" + d["files"][0][0]), "outside rank 0's directory"),
        (lambda d: d["files"][0].__setitem__(0, d["files"][0][0].replace("r00000", "r00001")), "shard of rank 0"),
        (lambda d: d["files"][0].__setitem__(0, "x" * 40 + ".safetensors"), "shard of rank 0"),
        (lambda d: d["chunks"]["a"].__setitem__(4, 10**12), "does not match its shape"),
        (lambda d: d["chunks"]["a"].__setitem__(1, [1]), "does not give 'a'"),
        (lambda d: d["chunks"]["a"].__setitem__(0, 5), "malformed"),
        (lambda d: d["chunks"]["a"].__setitem__(5, []), "checksums of 'a'"),
        (lambda d: d["chunks"].update(zzz=d["chunks"]["a"]), "not a stored tensor"),
        (lambda d: _share(d["chunks"]["m/bias"], d["chunks"]["a"]), "share bytes"),
        (lambda d: d.update(tree={"dict": [["a", {"tensor": "nope"}]]}), "no entry"),
        (lambda d: d["tree"]["dict"][1][1].update(extra=1), "a stateful node has the fields"),
    ],
)
def test_index_validation_names_the_problem_even_when_resealed(tmp_path, mutate, message):
    stashpoint.save(_state(), tmp_path / "ck")
    path, doc = index_doc(tmp_path / "ck")
    mutate(doc)
    reseal_index(tmp_path / "ck", path, doc)
    with pytest.raises(CorruptCheckpointError, match=message):
        stashpoint.load({"a": torch.zeros(3), "m": torch.nn.Linear(2, 2), "b": {}, "step": 0}, tmp_path / "ck")


def test_a_missing_or_replaced_index_is_named(tmp_path):
    stashpoint.save(_state(), tmp_path / "ck")
    path, doc = index_doc(tmp_path / "ck")
    raw = path.read_bytes()
    path.write_bytes(seal({**doc, "extra": 1}))  # sealed, but not the index the manifest names
    with pytest.raises(CorruptCheckpointError, match=r"index .* is \d+ bytes, the manifest says|checksum"):
        stashpoint.load({}, tmp_path / "ck", strict=False)
    path.unlink()
    with pytest.raises(CorruptCheckpointError, match="listed in the manifest is missing"):
        stashpoint.load({}, tmp_path / "ck", strict=False)
    # the tools do not call it damaged: one node's directory of a node-local run lacks the others'
    problems = " ".join(stashpoint.verify(tmp_path / "ck").problems)
    assert "node_local=True" in problems and "the checkpoint is damaged" not in problems, problems
    path.write_bytes(raw)
    stashpoint.load({}, tmp_path / "ck", strict=False)


@pytest.fixture(scope="module")
def v2_checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz2") / "ck"
    stashpoint.save(_state(), d)
    return d


@given(st.data())
@settings(max_examples=int(os.environ.get("STASHPOINT_FUZZ_EXAMPLES", "150")), deadline=None)
def test_loading_a_fuzzed_manifest_or_index_raises_only_checkpoint_errors(v2_checkpoint, tmp_path_factory, data):
    """Replace any node of the manifest or of the index by arbitrary JSON and re-seal both:
    loads and tools raise nothing but CheckpointError."""
    d = tmp_path_factory.mktemp("fz2") / "ck"
    shutil.copytree(v2_checkpoint, d)
    path, index = index_doc(d)
    head = json.loads((d / MANIFEST_NAME).read_bytes())
    doc = data.draw(st.sampled_from([head, index]))
    where = data.draw(st.sampled_from([p for p in _paths(doc) if p]))
    parent = doc
    for part in where[:-1]:
        parent = parent[part]
    parent[where[-1]] = data.draw(json_values)
    if doc is index:
        reseal_index(d, path, index)
    else:
        (d / MANIFEST_NAME).write_bytes(seal(head))
    from stashpoint._tools.inspect import describe

    for tool in (
        lambda: stashpoint.load({"a": torch.zeros(3), "m": torch.nn.Linear(2, 2), "b": {}, "step": 0}, d),
        lambda: stashpoint.load({}, d, strict=False),
        lambda: stashpoint.verify(d),
        lambda: describe(d),
        lambda: stashpoint.read(d),
    ):
        try:
            tool()
        except CheckpointError:
            pass


def test_group_directories_are_named_by_rank_and_only_exact_names_pass():
    from stashpoint._core.naming import group_dir, index_name, parse_save_file, placed, split_group

    assert (group_dir(1023, 1024), group_dir(1024, 1024), group_dir(5, 0)) == ("g00000", "g00001", "")
    assert placed("x", 2048, 1024) == "g00002/x" and placed("x", 2048, 0) == "x"
    assert parse_save_file(placed(index_name(2048, "ab"), 2048, 1024)) == (2048, "ab")
    assert split_group("g00002/x") == ("g00002", "x") and split_group("x") == ("", "x")
    for bad in ("g2/x", "g000002/x", "g00002/../x", "g00002/..", "a/b", "g00002/sub/x", "/x", "g00002/", "a\\b"):
        assert split_group(bad) is None, bad
        assert parse_save_file(bad) is None, bad


def test_a_bad_ranks_per_dir_setting_fails_the_save_clearly_and_commits_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("STASHPOINT_RANKS_PER_DIR", "abc")
    with pytest.raises(stashpoint.CheckpointError, match="STASHPOINT_RANKS_PER_DIR='abc' is not a number"):
        stashpoint.save({"a": torch.ones(2)}, tmp_path / "ck")
    assert not (tmp_path / "ck" / MANIFEST_NAME).exists()


def test_within_a_restore_each_manifest_and_index_is_parsed_once_and_changed_bytes_anew(tmp_path, monkeypatch):
    """A restore reads the manifest and indexes in several passes: ``remembering`` parses each
    distinct content once; a file whose bytes changed is parsed (and checked) again."""
    from stashpoint._load import manifest as m

    calls = {"head": 0, "index": 0}
    real_head, real_index = m.parse_head, m.parse_index

    def head(*a):
        calls["head"] += 1
        return real_head(*a)

    def index(*a):
        calls["index"] += 1
        return real_index(*a)

    monkeypatch.setattr(m, "parse_head", head)
    monkeypatch.setattr(m, "parse_index", index)
    from stashpoint._storage import LocalStorage

    state = {"w": torch.arange(6.0), "n": 3}
    stashpoint.save(state, tmp_path / "c")
    storage = LocalStorage(tmp_path / "c")
    with m.remembering():
        h = m.read_head(storage)
        assert m.read_head(storage) is h
        assert m.read_index(storage, h, 0) is m.read_index(storage, h, 0)
        assert calls == {"head": 1, "index": 1}
        raw = (tmp_path / "c" / MANIFEST_NAME).read_bytes()
        (tmp_path / "c" / MANIFEST_NAME).write_bytes(raw.replace(b'"format_version"', b'"format_versioN"'))
        with pytest.raises(CorruptCheckpointError):
            m.read_head(storage)  # new bytes: checked anew, not taken from the memo
        (tmp_path / "c" / MANIFEST_NAME).write_bytes(raw)
        target = {"w": torch.zeros(6), "n": 0}
        stashpoint.load(target, tmp_path / "c")  # plans once more (its first plan of this state), parses nothing
        assert calls["head"] == 2 and calls["index"] == 1
    assert torch.equal(target["w"], state["w"]) and target["n"] == 3
    m.read_head(storage)  # outside: no memo
    m.read_head(storage)
    assert calls["head"] == 4
    # a node-local restore: the listing, its three passes and the load parse the step's once
    with stashpoint.CheckpointManager(tmp_path / "run", node_local=True) as mgr:
        mgr.save(1, state)
    calls.update(head=0, index=0)
    with stashpoint.CheckpointManager(tmp_path / "run", node_local=True) as mgr:
        assert mgr.restore(target) == 1
    assert calls == {"head": 1, "index": 1}


def test_a_restore_holds_one_plan_at_a_time(tmp_path):
    """A fresh optimizer's plan holds state tensors made for it to load into: a restore that
    passes a damaged step by and plans the next must let the first plan's go (on a GPU, a
    second optimizer's worth of memory)."""
    import gc
    import weakref

    from stashpoint._load import manifest as m
    from stashpoint._load.loader import _own_plan
    from stashpoint._storage import LocalStorage

    model = torch.nn.Linear(64, 64)
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optim.step()
    for name in ("a", "b"):
        stashpoint.save({"model": model, "optim": optim}, tmp_path / name)
    fresh = torch.nn.Linear(64, 64)
    state = {"model": fresh, "optim": torch.optim.Adam(fresh.parameters())}
    with m.remembering():
        a = LocalStorage(tmp_path / "a")
        plan, _ = _own_plan(a, m.read_head(a), state, 0, partial=False, allow_pickle=False)
        made = [weakref.ref(r.dest) for r in plan.reads if r.key.startswith("optim") and r.dest.dim() > 0]
        assert len(made) == 4, "Adam's two moments for the weight and the bias"
        del plan
        b = LocalStorage(tmp_path / "b")
        _own_plan(b, m.read_head(b), state, 0, partial=False, allow_pickle=False)
        gc.collect()
        assert all(ref() is None for ref in made), "the first step's plan is let go"


def test_out_of_memory_for_a_fresh_optimizers_state_is_a_checkpoint_error(tmp_path, monkeypatch):
    """A GPU too full for a fresh optimizer's state to load into: a CheckpointError that names
    the state's key and the bytes, not torch's OutOfMemoryError out of the planner."""
    model = torch.nn.Linear(8, 8)
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optim.step()
    stashpoint.save({"model": model, "optim": optim}, tmp_path / "c")
    fresh = torch.nn.Linear(8, 8)
    state = {"model": fresh, "optim": torch.optim.Adam(fresh.parameters())}

    def full(*_a, **_k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 256.00 B")

    monkeypatch.setattr(torch, "empty_like", full)
    with pytest.raises(CheckpointError, match=r"cannot allocate 256 bytes on cpu for the optimizer state 'optim/"):
        stashpoint.load(state, tmp_path / "c")


def test_a_restore_passing_a_damaged_step_lets_its_plans_state_tensors_go(tmp_path, monkeypatch):
    """Through the manager: the newest step damaged, a fresh optimizer's state tensors made for
    its plan are gone before the next step's are made (the caught error's traceback held the
    load's frame, and its plan, before)."""
    import gc
    import weakref

    from stashpoint._load import optimplan

    model = torch.nn.Linear(32, 32)
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 32)).sum().backward()
    optim.step()
    with stashpoint.CheckpointManager(tmp_path / "run", keep_last=5) as mgr:
        mgr.save(1, {"model": model, "optim": optim})
        mgr.save(2, {"model": model, "optim": optim})
    step2 = next((tmp_path / "run").glob("step-*2"))
    shard = max((p for p in step2.rglob("shard-*")), key=lambda p: p.stat().st_size)
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 64] = bytes(64)
    shard.write_bytes(bytes(raw))

    made: list[weakref.ref] = []
    alive: list[int] = []
    real = optimplan._state_like

    def spy(param, dtype, key):
        gc.collect()
        alive.append(sum(ref() is not None for ref in made))
        t = real(param, dtype, key)
        made.append(weakref.ref(t))
        return t

    monkeypatch.setattr(optimplan, "_state_like", spy)
    fresh = torch.nn.Linear(32, 32)
    with stashpoint.CheckpointManager(tmp_path / "run") as mgr:
        assert mgr.restore({"model": fresh, "optim": torch.optim.Adam(fresh.parameters())}) == 1
    assert len(made) == 8, "4 state tensors for each step's plan"
    assert alive[4] == 0, f"step 2's are gone when step 1's are made: {alive}"
