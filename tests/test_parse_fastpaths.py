"""The manifest and index parsers check each entry without formatting a message unless a check
fails, and check the seal on the bytes as read. These tests hold them to the plain form of
each rule (written out here as the oracle): the same values pass, the same values fail, with
the same message; and a seal checked on the raw bytes still finds any damage."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import stashpoint
from stashpoint._core.catalog import Grid, Placement
from stashpoint._core.format import checksum
from stashpoint._core.index import _parse_grid
from stashpoint._core.naming import MANIFEST_NAME
from stashpoint._core.nodes import _LEAF_TYPES, MAX_TREE_DEPTH, check_tree
from stashpoint._core.reshard import Box, intersect
from stashpoint._core.sealed import MAX_DIMS, _int, _ints, _sealed_as_read, open_sealed, seal
from stashpoint.errors import CorruptCheckpointError
from test_format import json_values


def _want(cond: bool, what: str) -> None:
    if not cond:
        raise CorruptCheckpointError(f"malformed manifest w: {what}")


def oracle_int(v: object, what: str, lo: int = 0) -> int:
    _want(isinstance(v, int) and not isinstance(v, bool) and v >= lo, f"{what} must be an int >= {lo}")
    assert isinstance(v, int)
    return v


def oracle_ints(v: object, what: str) -> tuple[int, ...]:
    _want(isinstance(v, list) and len(v) <= MAX_DIMS, f"{what} must be a list of at most {MAX_DIMS} ints")
    assert isinstance(v, list)
    out = tuple(oracle_int(x, what) for x in v)
    _want(all(x < 2**62 for x in out), f"{what} holds a dimension over 2**62")
    return out


def oracle_tree(node: object, tensors: set[str], depth: int) -> None:
    _want(depth <= MAX_TREE_DEPTH, f"the state tree is nested deeper than {MAX_TREE_DEPTH} levels")
    _want(isinstance(node, dict), "tree node must be an object")
    assert isinstance(node, dict)
    if "stateful" in node:
        _want(node["stateful"] in ("module", "optimizer", "object"), "unknown stateful kind")
        _want(node.get("keyed_by", "name") in ("name", "index"), "unknown optimizer keying")
        oracle_tree(node.get("state"), tensors, depth + 1)
        return
    _want(len(node) == 1, f"tree node {str(node)[:80]!r} must have exactly one field")
    ((kind, value),) = node.items()
    if kind == "tensor":
        _want(isinstance(value, str) and value in tensors, f"tree names tensor {str(value)[:80]!r} with no entry")
    elif kind in _LEAF_TYPES:
        _want(isinstance(value, _LEAF_TYPES[kind]), f"malformed {kind} node")
        if kind == "float":
            _want(value in ("nan", "inf", "-inf"), "malformed float node")
    elif kind == "dict":
        _want(isinstance(value, list), "dict node must hold a list of [key, node] pairs")
        for item in value:
            ok = isinstance(item, list) and len(item) == 2 and isinstance(item[0], (str, int))
            _want(ok and not isinstance(item[0], bool), "dict node must hold [key, node] pairs")
            oracle_tree(item[1], tensors, depth + 1)
    elif kind in ("list", "tuple"):
        _want(isinstance(value, list), f"{kind} node must hold a list")
        for item in value:
            oracle_tree(item, tensors, depth + 1)
    else:
        _want(False, f"unknown tree node kind {kind!r}")


def _outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except CorruptCheckpointError as e:
        return ("error", str(e))


ints_like = st.lists(st.integers(-3, 2**63) | st.booleans() | st.none() | st.text(max_size=2), max_size=4)


@given(st.one_of(json_values, ints_like, st.lists(st.integers(0, 9), min_size=MAX_DIMS, max_size=MAX_DIMS + 1)))
@settings(max_examples=400, deadline=None)
def test_int_checks_pass_and_fail_as_the_plain_rules_do(v):
    assert _outcome(lambda: _ints(v, "w", "offsets", key="k")) == _outcome(oracle_ints, v, "offsets of 'k'")
    assert _outcome(_ints, v, "w", "shape") == _outcome(oracle_ints, v, "shape")
    for lo in (0, 1, 8):
        assert _outcome(lambda: _int(v, "w", "start", lo, key="k")) == _outcome(oracle_int, v, "start of 'k'", lo)


tree_leaf = st.one_of(
    st.fixed_dictionaries({"tensor": st.sampled_from(["a", "b", "zz"]) | json_values}),
    st.fixed_dictionaries({"value": json_values}),
    st.fixed_dictionaries({"float": st.sampled_from(["nan", "inf", "-inf", "1.0"]) | json_values}),
    st.fixed_dictionaries({"bytes": json_values}),
    json_values,
)
trees = st.recursive(
    tree_leaf,
    lambda kids: st.one_of(
        st.fixed_dictionaries(
            {
                "dict": st.lists(
                    st.tuples(st.text(max_size=3) | st.integers() | st.booleans(), kids).map(list), max_size=3
                )
            }
        ),
        st.fixed_dictionaries({"list": st.lists(kids, max_size=3)}),
        st.fixed_dictionaries({"tuple": st.lists(kids, max_size=3) | json_values}),
        st.fixed_dictionaries(
            {"stateful": st.sampled_from(["module", "optimizer", "object", "x"]), "state": kids},
            optional={"keyed_by": st.sampled_from(["name", "index", "rank"])},
        ),
        st.dictionaries(st.sampled_from(["dict", "list", "value", "future"]), kids, min_size=2, max_size=3),
    ),
    max_leaves=16,
)


@given(trees)
@settings(max_examples=400, deadline=None)
def test_tree_checks_pass_and_fail_as_the_plain_rules_do(tree):
    assert _outcome(check_tree, tree, {"a", "b"}, "w", 0) == _outcome(oracle_tree, tree, {"a", "b"}, 0)


def test_a_tree_nested_too_deep_is_refused_with_the_same_message():
    tree: dict = {"value": 1}
    for _ in range(MAX_TREE_DEPTH + 1):
        tree = {"list": [tree]}
    assert _outcome(check_tree, tree, set(), "w", 0) == _outcome(oracle_tree, tree, set(), 0)
    assert _outcome(check_tree, tree, set(), "w", 0)[0] == "error"


def test_the_seal_is_checked_on_the_bytes_as_read_and_finds_any_damage(tmp_path):
    stashpoint.save({"w": torch.ones(4), "step": 7}, tmp_path / "ck")
    raw = (tmp_path / "ck" / MANIFEST_NAME).read_bytes()
    doc = json.loads(raw)
    assert _sealed_as_read(raw, doc["checksum"])  # what seal() writes takes the fast path
    open_sealed(raw, "m")
    for i in range(0, len(raw) - 1, max(1, len(raw) // 97)):  # one byte changed anywhere
        bad = raw[:i] + bytes([raw[i] ^ 0x01]) + raw[i + 1 :]
        with pytest.raises(CorruptCheckpointError):
            open_sealed(bad, "m")
    # the same document written with spaces (not as seal() writes it) is checked the slow way
    spaced = json.dumps(json.loads(raw), indent=1).encode()
    assert not _sealed_as_read(spaced, doc["checksum"])
    assert open_sealed(spaced, "m")[0] == open_sealed(raw, "m")[0]
    (tmp_path / "ck" / MANIFEST_NAME).write_bytes(spaced)
    out = {"w": torch.zeros(4), "step": 0}
    stashpoint.load(out, tmp_path / "ck")
    assert torch.equal(out["w"], torch.ones(4)) and out["step"] == 7
    # a body changed but the seal's tail kept: the raw check fails, and so does the slow one
    j = raw.index(b'"step"') if b'"step"' in raw else raw.index(b"float32")
    changed = raw[:j] + raw[j : j + 8].upper() + raw[j + 8 :]
    with pytest.raises(CorruptCheckpointError, match="checksum does not match"):
        open_sealed(changed, "m")


def test_a_manifest_resealed_after_any_change_still_goes_through_every_rule(tmp_path):
    stashpoint.save({"w": torch.ones(4)}, tmp_path / "ck")
    path = tmp_path / "ck" / MANIFEST_NAME
    doc = json.loads(path.read_bytes())
    key = next(iter(doc["tensors"]))
    for field, value, message in (
        ("shape", [4, True], "shape of"),
        ("shape", [-1], "shape of"),
        ("dtype", "float99", "unknown dtype 'float99'"),
    ):
        bad = json.loads(json.dumps(doc))
        bad["tensors"][key][field] = value
        path.write_bytes(seal(bad))
        with pytest.raises(CorruptCheckpointError, match=message):
            stashpoint.load({"w": torch.zeros(4)}, tmp_path / "ck")


def _sealed_over_its_bytes(doc: dict, **dumps) -> bytes:
    """``doc`` written as ``json.dumps(**dumps)`` writes it, sealed over those very bytes (not
    over the compact form seal() hashes)."""
    from stashpoint._core.sealed import checksum

    text = json.dumps({k: v for k, v in doc.items() if k != "checksum"}, **dumps)
    assert text.endswith("}")
    prefix = text[:-1]
    return (prefix + ',"checksum":' + json.dumps(checksum((prefix + "}").encode())) + "}").encode()


def test_a_document_sealed_over_its_own_bytes_passes_only_with_finite_numbers(tmp_path):
    stashpoint.save({"w": torch.ones(4)}, tmp_path / "ck")
    doc = json.loads((tmp_path / "ck" / MANIFEST_NAME).read_bytes())
    spaced = _sealed_over_its_bytes(doc, indent=1)  # another writer's layout, sealed as written
    assert open_sealed(spaced, "m")[0] == {k: v for k, v in doc.items() if k != "checksum"}
    for odd in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(CorruptCheckpointError, match="checksum does not match"):
            open_sealed(_sealed_over_its_bytes({**doc, "extra": odd}, indent=1), "m")
    big = _sealed_over_its_bytes({**doc, "extra": 1.5}, indent=1).replace(b"1.5", b"1e400")
    with pytest.raises(CorruptCheckpointError, match="checksum does not match"):
        open_sealed(big, "m")  # 1e400 parses as inf (its seal is stale too: either way, refused)


def test_hostile_catalog_and_index_entries_raise_checkpoint_errors(tmp_path):
    from conftest import index_doc, reseal_index

    stashpoint.save({"w": torch.ones(4)}, tmp_path / "ck")
    path = tmp_path / "ck" / MANIFEST_NAME
    doc = json.loads(path.read_bytes())
    key = next(iter(doc["tensors"]))
    for chunks in (3, 1.5, None, True):  # counted before parsing: len() of these raised TypeError
        bad = json.loads(json.dumps(doc))
        bad["tensors"][key] = {"dtype": "float32", "shape": [4], "chunks": chunks}
        path.write_bytes(seal(bad))
        with pytest.raises(CorruptCheckpointError, match="neither a grid nor chunks"):
            stashpoint.load({"w": torch.zeros(4)}, tmp_path / "ck")
    path.write_bytes(seal(doc))
    ipath, index = index_doc(tmp_path / "ck")
    index["chunks"][key][0] = False  # a file number given as a bool
    reseal_index(tmp_path / "ck", ipath, index)
    with pytest.raises(CorruptCheckpointError, match=f"the chunk of '{key}' is malformed"):
        stashpoint.load({"w": torch.zeros(4)}, tmp_path / "ck")


def oracle_grid(
    key: str, g: object, shape: tuple[int, ...], world: int
) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
    _want(isinstance(g, dict), f"grid of {key!r} must be an object")
    assert isinstance(g, dict)
    block = oracle_ints(g.get("block"), f"grid block of {key!r}")
    strides = g.get("strides")
    ok = isinstance(strides, list) and all(type(s) is int for s in strides)
    _want(ok and len(block) == len(shape) == len(strides), f"grid of {key!r} does not match its shape")
    _want(all(b > 0 for b in block) and math.prod(shape) > 0, f"grid of {key!r} has an empty block")
    base = oracle_int(g.get("base"), f"grid base of {key!r}")
    counts = [-(-n // b) for n, b in zip(shape, block)]
    n = math.prod(counts)
    _want(n <= world, f"grid of {key!r} has {n} cells, more than the {world} ranks could write")
    lo = base + sum(min(0, s * (c - 1)) for s, c in zip(strides, counts))
    hi = base + sum(max(0, s * (c - 1)) for s, c in zip(strides, counts))
    _want(lo >= 0 and hi < world, f"grid of {key!r} names ranks outside the world")
    return block, base, tuple(strides)


small_shapes = st.lists(st.integers(0, 6), min_size=1, max_size=3).map(tuple)


@given(
    small_shapes,
    st.data(),
    st.integers(1, 12),
)
@settings(max_examples=600, deadline=None)
def test_grid_checks_pass_and_fail_as_the_plain_rules_do(shape, data, world):
    """The one-cell fast path (a tensor saved whole) agrees with the general rules."""
    n = len(shape)
    block = data.draw(st.just(list(shape)) | st.lists(st.integers(0, 7), min_size=n, max_size=n) | ints_like)
    strides = data.draw(st.lists(st.integers(-4, 4), min_size=n, max_size=n) | ints_like | st.none())
    base = data.draw(st.integers(-1, 13) | st.booleans() | st.none())
    g = data.draw(st.just({"block": block, "strides": strides, "base": base}) | json_values)

    def ours() -> tuple[tuple[int, ...], int, tuple[int, ...]]:
        p = _parse_grid("k", g, "float32", shape, world=world, where="w")
        assert p.grid is not None
        return p.grid.block, p.grid.base, p.grid.strides

    assert _outcome(ours) == _outcome(oracle_grid, "k", g, shape, world)


def oracle_expects(p: Placement, box: Box, rank: int) -> bool:
    assert p.grid is not None
    if not len(box.offsets) == len(box.shape) == len(p.shape):
        return False
    b = p.grid.block
    if any(o % k for o, k in zip(box.offsets, b)):
        return False
    cell = tuple(o // k for o, k in zip(box.offsets, b))
    want = tuple(min(k, n - o) for k, n, o in zip(b, p.shape, box.offsets))
    counts = p.grid.counts(p.shape)
    return want == box.shape and all(i < c for i, c in zip(cell, counts)) and p.grid.writer(cell) == rank


@given(small_shapes, st.data())
@settings(max_examples=600, deadline=None)
def test_a_grid_expects_the_chunks_the_plain_rule_gives(shape, data):
    n = len(shape)
    block = tuple(data.draw(st.lists(st.integers(1, 7), min_size=n, max_size=n)))
    grid = Grid(
        block, data.draw(st.integers(0, 3)), tuple(data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)))
    )
    p = Placement("k", "float32", shape, grid)
    dims = data.draw(st.just(n) | st.integers(0, 4))  # another number of dimensions than the tensor's, too
    offsets = tuple(data.draw(st.lists(st.integers(0, 7), min_size=dims, max_size=dims) | st.just([0] * dims)))
    box = Box(offsets, tuple(data.draw(st.lists(st.integers(0, 7), min_size=dims, max_size=dims) | st.just(shape))))
    for rank in range(5):
        assert p.expects(box, rank) == oracle_expects(p, box, rank), (box, rank)


@given(small_shapes, st.data())
@settings(max_examples=400, deadline=None)
def test_a_grid_finds_the_chunks_over_a_region_as_the_plain_rule_does(shape, data):
    n = len(shape)
    block = data.draw(st.just(shape) | st.lists(st.integers(1, 7), min_size=n, max_size=n).map(tuple))
    grid = Grid(
        block, data.draw(st.integers(0, 3)), tuple(data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)))
    )
    p = Placement("k", "float32", shape, grid)
    offsets = [data.draw(st.integers(0, max(0, d - 1))) for d in shape]
    region = Box(tuple(offsets), tuple(data.draw(st.integers(0, d - o)) for d, o in zip(shape, offsets)))
    want = []  # every cell of the grid that meets the region
    if region.numel:
        for cell in itertools.product(*(range(-(-d // k)) for d, k in zip(shape, block))):
            box = Box(
                tuple(i * k for i, k in zip(cell, block)),
                tuple(min(k, d - i * k) for i, k, d in zip(cell, block, shape)),
            )
            if intersect(box, region) is not None:
                want.append((box, grid.writer(cell)))
    assert sorted(p.overlapping(region), key=str) == sorted(want, key=str)


@pytest.mark.parametrize("offsets", [[], [0], [0, 0, 0]])
def test_an_index_chunk_of_other_dimensions_than_its_tensor_is_refused(tmp_path, offsets):
    """Before: offsets ``[]`` for a 2-D tensor passed the whole-tensor fast path, and ``[0, 0, 0]``
    the general rule (its zip stopped at the shorter); ``verify`` said such a checkpoint was fine."""
    path = tmp_path / "ck"
    stashpoint.save({"w": torch.ones(4, 4)}, path)
    (index,) = path.glob("index-*.json")
    doc = json.loads(index.read_bytes())
    doc.pop("checksum")
    doc["chunks"]["w"][1] = offsets
    index.write_bytes(seal(doc))
    manifest = json.loads((path / MANIFEST_NAME).read_bytes())
    manifest.pop("checksum")
    manifest["indexes"][0] = [index.stat().st_size, checksum(index.read_bytes())]
    (path / MANIFEST_NAME).write_bytes(seal(manifest))
    report = stashpoint.verify(path)
    assert not report.ok and any("other dimensions than its tensor" in p for p in report.problems), report
    with pytest.raises(CorruptCheckpointError, match="other dimensions than its tensor"):
        stashpoint.load({"w": torch.zeros(4, 4)}, path)
