"""Saves of one structure in one process: the plan, the files' layouts and the catalog's JSON
are made once and kept (a 40k-tensor save spent most of its persist remaking them). What is
kept must never leak into a save of another structure, or of other values."""

from __future__ import annotations

import dataclasses
import gc
import json
import threading

import pytest
import torch

import stashpoint
from stashpoint._core.catalog import Grid, Placement
from stashpoint._core.index import Head, catalog_json
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
    ahead = dataclasses.replace(head, encoded_catalog=catalog_json(catalog))
    assert ahead.to_json() == head.to_json()


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
