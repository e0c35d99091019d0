"""The on-disk format: golden bytes, manifest validation, safetensors interop."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import stashpoint
from conftest import index_doc, to_v1, v1_doc
from stashpoint._core.format import parse_manifest, seal
from stashpoint._core.header import encode_entries, encode_header, parse_header
from stashpoint._core.naming import MANIFEST_NAME
from stashpoint.errors import CheckpointError, CorruptCheckpointError


def test_header_golden_bytes():
    raw = encode_header(encode_entries([("w", "F32", [2], 0, 8)]), {"format": "stashpoint", "save_id": "00"}, align=64)
    body = (
        b'{"__metadata__":{"format":"stashpoint","save_id":"00"},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    )
    assert len(body) == 108
    expected = struct.pack("<Q", 120) + body + b" " * 12
    assert raw == expected
    assert len(raw) % 64 == 0


def test_shard_file_golden_bytes(tmp_path):
    """A whole checkpoint of one tensor, byte for byte (save_id and checksums aside)."""
    stashpoint.save({"w": torch.tensor([1.0, 2.0])}, tmp_path / "ck")
    shards = sorted((tmp_path / "ck").glob("shard-*.safetensors"))
    assert len(shards) == 1
    data = shards[0].read_bytes()
    save_id = shards[0].name.split("-")[-1].split(".")[0]
    body = (
        '{"__metadata__":{"format":"stashpoint","save_id":"' + save_id + '"},'
        '"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    ).encode()
    n = 4096 - 8
    assert data[:8] == struct.pack("<Q", n)
    assert data[8 : 8 + len(body)] == body
    assert data[8 + len(body) : 4096] == b" " * (n - len(body))
    assert data[4096:] == b"\x00\x00\x80\x3f\x00\x00\x00\x40"  # 1.0f, 2.0f little-endian
    manifest = json.loads((tmp_path / "ck" / MANIFEST_NAME).read_bytes())
    assert manifest["format"] == "stashpoint" and manifest["format_version"] == 2
    grid = {"block": [2], "base": 0, "strides": [0]}
    assert manifest["tensors"] == {"w": {"dtype": "float32", "shape": [2], "grid": grid}}
    assert manifest["checksum_block_bytes"] == 4 * 1024 * 1024 and manifest["world_size"] == 1
    index_path = tmp_path / "ck" / f"index-r00000-{save_id}.json"
    raw = index_path.read_bytes()
    assert manifest["indexes"] == [[len(raw), xxhash.xxh3_64_hexdigest(raw)]]
    index = json.loads(raw)
    assert index["format"] == "stashpoint-index" and index["rank"] == 0 and index["save_id"] == save_id
    assert index["tree"] == {"dict": [["w", {"tensor": "w"}]]}
    assert index["files"] == [[shards[0].name, 4104, 4096, xxhash.xxh3_64_hexdigest(data[:4096])]]
    sums = [xxhash.xxh3_64_hexdigest(b"\x00\x00\x80\x3f\x00\x00\x00\x40")]
    assert index["chunks"] == {"w": [0, [0], [2], 4096, 4104, sums]}


ALL_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex32,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
    torch.float4_e2m1fn_x2,
    torch.bits8,
    torch.bits16,
]


def _random_tensor(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    n = math.prod(shape)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8)
    if dtype == torch.bool:
        return (raw % 2 == 1).reshape(shape)
    return raw.view(dtype).reshape(shape)


def test_any_safetensors_reader_opens_the_shards(tmp_path):
    from safetensors import safe_open

    state = {f"t{i}": _random_tensor(d) for i, d in enumerate(ALL_DTYPES)}
    stashpoint.save(state, tmp_path / "ck")
    (shard,) = (tmp_path / "ck").glob("shard-*.safetensors")
    with safe_open(str(shard), framework="pt") as f:
        keys = set(f.keys())
        assert keys == set(state)
        for k, t in state.items():
            got = f.get_tensor(k)
            raw = t.contiguous().view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
            # dtypes safetensors does not know are listed as raw bytes
            assert got.view(torch.uint8).flatten().tolist() == raw.flatten().tolist(), k


def _manifest(tmp_path) -> bytes:
    """A version-1 manifest (its rules still hold for the checkpoints written that way)."""
    stashpoint.save({"a": torch.ones(3), "b": {"c": 1}}, tmp_path / "m")
    return (to_v1(tmp_path / "m") / MANIFEST_NAME).read_bytes()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(format="other"), "not a stashpoint manifest"),
        (lambda d: d.update(format_version=99), "upgrade stashpoint"),
        (lambda d: d["files"][0].update(name="../evil"), "points outside the checkpoint"),
        (lambda d: d["files"][0].update(name="/etc/passwd"), "points outside the checkpoint"),
        (lambda d: d["tensors"]["a"]["chunks"][0].update(end=10**12), "does not match its shape"),
        (lambda d: d["tensors"]["a"]["chunks"][0].update(file="nope"), "unlisted file"),
        (lambda d: d["tensors"]["a"].update(dtype="evil"), "unknown dtype"),
        (lambda d: d["tensors"]["a"].update(shape=[1] * 100), "at most 64"),
        (lambda d: d.pop("trees"), "trees must be a non-empty list"),
        (lambda d: d["tensors"]["a"]["chunks"][0].update(shape=[2], end=4096 + 8, checksums=["0"]), "hold 2 elements"),
        (lambda d: d["tensors"]["a"]["chunks"].append(dict(d["tensors"]["a"]["chunks"][0])), "hold 6 elements"),
        (lambda d: d.update(tree_of_rank=[3]), "tree_of_rank"),
    ],
)
def test_manifest_validation_names_the_problem(tmp_path, mutate, message):
    doc = json.loads(_manifest(tmp_path))
    mutate(doc)
    with pytest.raises(CorruptCheckpointError, match=message):
        parse_manifest(seal(doc), "x")


@given(st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_manifest_parser_fuzz_raises_only_checkpoint_errors(data):
    try:
        parse_manifest(data, "fuzz")
    except CheckpointError:
        pass


@given(st.binary(max_size=200), st.integers(0, 10**6))
@settings(max_examples=300, deadline=None)
def test_header_parser_fuzz_raises_only_checkpoint_errors(data, size):
    try:
        parse_header(data, size, "fuzz")
    except CheckpointError:
        pass


def test_header_claiming_huge_size_is_refused_without_allocating():
    raw = struct.pack("<Q", 2**62) + b"{}"
    with pytest.raises(CorruptCheckpointError, match="invalid header length"):
        parse_header(raw, 10, "x")


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=12,
)


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, (*prefix, i))


@pytest.fixture(scope="module")
def valid_manifest(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    stashpoint.save({"a": torch.ones(3), "m": torch.nn.Linear(2, 2), "b": {"c": [1, 2.5, "x"]}}, d / "ck")
    return v1_doc(d / "ck"), d / "ck"


@given(st.data())
@settings(max_examples=500, deadline=None)
def test_structured_manifest_fuzz_raises_only_checkpoint_errors(valid_manifest, data):
    """Replace any node of a valid manifest by arbitrary JSON: only CheckpointError may escape."""
    doc = json.loads(json.dumps(valid_manifest[0]))
    paths = [p for p in _paths(doc) if p]
    path = data.draw(st.sampled_from(paths))
    parent = doc
    for part in path[:-1]:
        parent = parent[part]
    parent[path[-1]] = data.draw(json_values)
    try:
        parse_manifest(seal(doc), "fuzz")
    except CheckpointError:
        pass


@given(st.data())
@settings(max_examples=int(os.environ.get("STASHPOINT_FUZZ_EXAMPLES", "150")), deadline=None)
def test_loading_a_fuzzed_manifest_raises_only_checkpoint_errors(valid_manifest, tmp_path_factory, data):
    """The same, through a whole load: planner and reader must not crash on a hostile manifest."""
    doc = json.loads(json.dumps(valid_manifest[0]))
    path = data.draw(st.sampled_from([p for p in _paths(doc) if p]))
    parent = doc
    for part in path[:-1]:
        parent = parent[part]
    parent[path[-1]] = data.draw(json_values)
    d = tmp_path_factory.mktemp("fz")
    for shard in valid_manifest[1].glob("shard-*"):
        shutil.copy(shard, d / shard.name)
    (d / MANIFEST_NAME).write_bytes(seal(doc) if isinstance(doc, dict) else json.dumps(doc).encode())
    for target in ({}, {"a": torch.zeros(3), "m": torch.nn.Linear(2, 2), "b": {}}):
        try:
            stashpoint.load(target, d)
        except CheckpointError:
            pass
    from stashpoint._tools.convert import export
    from stashpoint._tools.diff import diff
    from stashpoint._tools.inspect import describe

    out = d.parent / "out.safetensors"
    for tool in (
        lambda: stashpoint.verify(d),
        lambda: describe(d),
        lambda: stashpoint.read(d),
        lambda: diff(d, valid_manifest[1]),
        lambda: export(d, out, overwrite=True),
    ):  # the tools too: nothing but CheckpointError
        try:
            tool()
        except CheckpointError:
            pass


def test_unknown_fields_are_ignored_and_unknown_tree_nodes_refused_as_format_md_says(tmp_path):
    raw = json.loads(_manifest(tmp_path))
    doc = {**raw, "future": {"x": 1}}
    doc["files"][0]["future"] = 1
    doc["tensors"]["a"]["future"] = [1]
    doc["tensors"]["a"]["chunks"][0]["future"] = "x"
    (tmp_path / "m" / MANIFEST_NAME).write_bytes(seal(doc))
    out = {"a": torch.zeros(3), "b": {"c": 0}}
    stashpoint.load(out, tmp_path / "m")
    assert torch.equal(out["a"], torch.ones(3)) and out["b"] == {"c": 1}
    for node in ({"set": []}, {"value": 1, "future": 2}):
        bad = json.loads(json.dumps(raw))
        bad["trees"][0]["dict"][1][1]["dict"][0][1] = node  # b/c
        (tmp_path / "m" / MANIFEST_NAME).write_bytes(seal(bad))
        with pytest.raises(CorruptCheckpointError, match=r"tree node|unknown tree node kind"):
            stashpoint.load({"a": torch.zeros(3), "b": {"c": 0}}, tmp_path / "m")


def test_any_damage_to_the_manifest_is_detected(tmp_path):
    stashpoint.save({"w": torch.ones(2), "step": 1234, "name": "run"}, tmp_path / "ck")
    path = tmp_path / "ck" / MANIFEST_NAME
    raw = path.read_bytes()
    assert json.loads(raw)["checksum"]
    i = raw.index(b"float32")
    path.write_bytes(raw[:i] + b"float16" + raw[i + 7 :])
    with pytest.raises(CorruptCheckpointError, match="checksum does not match its contents"):
        stashpoint.load({"w": torch.zeros(2)}, tmp_path / "ck")
    path.write_bytes(raw)
    index, _ = index_doc(tmp_path / "ck")
    iraw = index.read_bytes()
    i = iraw.index(b"1234")
    index.write_bytes(iraw[:i] + b"1235" + iraw[i + 4 :])  # a plain value, nothing else would notice
    with pytest.raises(CorruptCheckpointError, match="does not match the manifest's checksum"):
        stashpoint.load({"w": torch.zeros(2)}, tmp_path / "ck")


@given(
    st.dictionaries(
        st.text(max_size=8),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=8),
            lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
            max_leaves=12,
        ),
        max_size=6,
    )
)
@settings(max_examples=150, deadline=None)
def test_a_seal_is_the_document_encoded_with_its_checksum_last(doc):
    """``seal`` appends the seal to the encoded body: the same bytes as the document with the
    field added last and encoded once more (what a load hashes when the tail does not match)."""
    doc.pop("checksum", None)
    body = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    whole = dict(doc, checksum=xxhash.xxh3_64_hexdigest(body))
    assert seal(doc) == json.dumps(whole, separators=(",", ":"), allow_nan=False).encode()
