"""Saves of one structure in one process: the plan, the files' layouts and the catalog's JSON
are made once and kept (a 40k-tensor save spent most of its persist remaking them). What is
kept must never leak into a save of another structure, or of other values."""

from __future__ import annotations

import gc
import json
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import stashpoint
from stashpoint._core.catalog import Grid, Placement
from stashpoint._core.format import Chunk, FileEntry, seal
from stashpoint._core.header import encode_entries
from stashpoint._core.index import Head, RankIndex, catalog_json
from stashpoint._core.naming import MANIFEST_NAME
from stashpoint._save.engine import get_engine


def _state(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(3 + i % 4, generator=g) for i in range(n)}


def _loaded(path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    stashpoint.load(out, path)
    return out


def test_one_structure_is_planned_once_and_each_save_holds_its_own_values(tmp_path):
    solo = get_engine().solo
    made = solo.plans_made
    a, b = _state(40, 0), _state(40, 1)
    stashpoint.save(a, tmp_path / "a")
    stashpoint.save(b, tmp_path / "b")  # same structure, other values
    c = {**_state(40, 2), "extra": torch.arange(5.0)}  # another structure
    stashpoint.save(c, tmp_path / "c")
    stashpoint.save(a, tmp_path / "a2", max_shard_bytes=256)  # the first structure, in other files
    assert solo.plans_made - made == 3  # a, c, and a again after c (b reused a's plan)
    for name, want in (("a", a), ("b", b), ("c", c), ("a2", a)):
        got = _loaded(tmp_path / name, want)
        assert all(torch.equal(got[k], want[k]) for k in want), name
        doc = json.loads((tmp_path / name / MANIFEST_NAME).read_bytes())
        assert sorted(doc["tensors"]) == sorted(want), name  # the catalog of the structure saved
    assert len(list((tmp_path / "a2").glob("shard-*"))) > 1


def test_a_save_after_a_changed_value_is_written_anew(tmp_path):
    state = _state(8, 0)
    stashpoint.save(state, tmp_path / "one")
    before = state["w3"].clone()
    state["w3"].add_(1.0)
    stashpoint.save(state, tmp_path / "two")
    one, two = _loaded(tmp_path / "one", state), _loaded(tmp_path / "two", state)
    assert torch.equal(two["w3"], state["w3"]) and torch.equal(one["w3"], before)


@pytest.mark.parametrize("grid", [True, False])
def test_a_catalog_encoded_ahead_is_the_one_the_manifest_would_encode(grid):
    catalog = {
        "é": Placement(
            "é", "float32", (4, 2), Grid((2, 2), 0, (1, 0)) if grid else None, () if grid else (((0, 0), (4, 2), 1),)
        ),
        "b": Placement("b", "int64", (3,), alias_of="a")
        if not grid
        else Placement("b", "int64", (3,), Grid((3,), 1, (0,))),
    }
    head = Head("ab12", "2026-12-06", "0", "2", 2, ((10, "x"), (11, "y")), catalog, {"m": "v"})
    assert head.to_json(catalog_json(catalog)) == head.to_json()


def test_a_persist_never_switches_the_collector(tmp_path, monkeypatch):
    """The collector is the process's: a pause the writer thread took while training runs would
    undo a ``gc.disable()`` the training thread made meanwhile. Only the caller's thread pauses it."""
    threads: list[str] = []
    disable = gc.disable

    def spy() -> None:
        threads.append(threading.current_thread().name)
        disable()

    monkeypatch.setattr(gc, "disable", spy)
    state = _state(2000, 0)
    stashpoint.save(state, tmp_path / "a")
    stashpoint.save(state, tmp_path / "b")
    assert threads and all(not name.startswith("stashpoint-") for name in threads), threads


_names = st.text(max_size=6)  # any text: quotes, escapes, non-ASCII
_dims = st.lists(st.integers(0, 2**40), max_size=3).map(tuple)


def _doc(p: Placement) -> dict[str, object]:
    """What the manifest holds of ``p`` (FORMAT.md), as json.dumps would be given it."""
    doc: dict[str, object] = {"dtype": p.dtype, "shape": list(p.shape)}
    if p.alias_of is not None:
        doc["alias_of"] = p.alias_of
    elif p.grid is not None:
        doc["grid"] = {"block": list(p.grid.block), "base": p.grid.base, "strides": list(p.grid.strides)}
    else:
        doc["chunks"] = [[list(o), list(s), w] for o, s, w in p.cells]
    return doc


_placements = st.builds(
    lambda key, dtype, shape, kind, n, target: Placement(
        key,
        dtype,
        shape,
        Grid(shape, n, tuple(-n for _ in shape)) if kind == "grid" else None,
        ((shape, shape, n), ((), shape, n + 1)) if kind == "cells" else (),
        target if kind == "alias" else None,
    ),
    _names,
    _names,
    _dims,
    st.sampled_from(["grid", "cells", "alias"]),
    st.integers(0, 2**20),
    _names,
)


@given(st.lists(_placements, max_size=5))
@settings(max_examples=200, deadline=None)
def test_the_catalog_written_as_text_is_what_json_dumps_writes(placements):
    catalog = {p.key: p for p in placements}
    want = json.dumps({k: _doc(p) for k, p in catalog.items()}, separators=(",", ":")).encode()
    assert catalog_json(catalog) == want


@given(st.lists(st.tuples(_names, _names, st.lists(st.integers(0, 2**40), max_size=3), st.integers(0), st.integers(0))))
@settings(max_examples=200, deadline=None)
def test_a_headers_entries_written_as_text_are_what_json_dumps_writes(entries):
    doc = {n: {"dtype": t, "shape": list(s), "data_offsets": [b, e]} for n, t, s, b, e in entries}
    if len(doc) == len(entries):  # (a file's names are unique)
        assert encode_entries(entries) == json.dumps(doc, separators=(",", ":")).encode()[1:-1]


_trees = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | _names,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_names, inner, max_size=3),
    max_leaves=8,
)


@given(
    st.dictionaries(_names, st.tuples(_dims, _dims, st.integers(0), st.integers(0), st.lists(_names, max_size=2))),
    st.dictionaries(_names, _trees, max_size=3),
)
@settings(max_examples=200, deadline=None)
def test_an_index_written_as_text_is_what_json_dumps_writes(chunks, tree):
    files = (FileEntry("shard-a", 10, 8, "x"), FileEntry("shard-b", 20, 8, "y"))
    made = {k: Chunk(files[len(k) % 2].name, o, s, b, e, tuple(sums)) for k, (o, s, b, e, sums) in chunks.items()}
    rows = {k: [len(k) % 2, list(c.offsets), list(c.shape), c.start, c.end, list(c.checksums)] for k, c in made.items()}
    want = seal(
        {
            "format": "stashpoint-index",
            "format_version": 2,
            "save_id": "ab",
            "rank": 3,
            "checksum_algorithm": "xxh3_64",
            "checksum_block_bytes": 4 << 20,
            "files": [[f.name, f.size, f.data_start, f.header_checksum] for f in files],
            "chunks": rows,
            "tree": tree,
        }
    )
    assert RankIndex(3, "ab", files, made, tree).to_json() == want


def test_a_state_without_tensors_writes_no_shard_file(tmp_path):
    """A rank given nothing to write writes no file (plan_files of nothing plans one empty file,
    which the staging plan holds: it is not taken for the files)."""
    for name in ("a", "b"):  # the second save reuses the structure's plan
        stashpoint.save({"step": 3, "name": "run"}, tmp_path / name)
        assert not list((tmp_path / name).glob("shard-*")), sorted(p.name for p in (tmp_path / name).iterdir())
        assert stashpoint.read(tmp_path / name) == {"step": 3, "name": "run"}
