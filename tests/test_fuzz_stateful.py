"""Hostile trees for the stateful adapters (optimizer, LR scheduler, RNG state, sampler, module):
a re-sealed manifest whose state tree was changed anywhere makes ``load`` raise nothing but
CheckpointError, and a load that raises changes nothing an object's ``load_state_dict`` owns."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import stashpoint
from conftest import index_doc, reseal_index
from stashpoint._core.naming import MANIFEST_NAME
from stashpoint.errors import CheckpointError


def _objects(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2)
    data = torch.utils.data.TensorDataset(torch.arange(20.0))
    sampler = stashpoint.StatefulSampler(data, seed=0)
    return {"model": model, "optim": optim, "sched": sched, "rng": stashpoint.RNGState(), "sampler": sampler, "step": 3}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("stateful") / "ck"
    state = _objects()
    state["model"](torch.randn(3, 4)).sum().backward()
    state["optim"].step()
    state["sched"].step()
    list(iter(state["sampler"]))[:5]
    stashpoint.save(state, d)
    return index_doc(d)[1], d, json.loads((d / MANIFEST_NAME).read_bytes())


def _node_paths(node, prefix=()):
    """Paths (into the JSON) of every tree node under ``node``."""
    yield prefix
    if "stateful" in node:
        yield from _node_paths(node["state"], (*prefix, "state"))
    elif "dict" in node:
        for i, (_, child) in enumerate(node["dict"]):
            yield from _node_paths(child, (*prefix, "dict", i, 1))
    elif "list" in node or "tuple" in node:
        kind = "list" if "list" in node else "tuple"
        for i, child in enumerate(node[kind]):
            yield from _node_paths(child, (*prefix, kind, i))


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=5),
)


def tree_nodes(tensor_keys: list[str]):
    leaf = st.one_of(
        scalars.map(lambda v: {"value": v}),
        st.sampled_from(["nan", "inf", "-inf"]).map(lambda v: {"float": v}),
        st.sampled_from(tensor_keys).map(lambda k: {"tensor": k}),
        st.just({"bytes": "AAEC"}),
    )
    return st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3).map(lambda xs: {"list": xs}),
            st.lists(inner, max_size=3).map(lambda xs: {"tuple": xs}),
            st.lists(st.tuples(st.one_of(st.text(max_size=4), st.integers(-3, 3)), inner), max_size=3).map(
                lambda kv: {"dict": [[k, v] for k, v in kv]}
            ),
        ),
        max_leaves=8,
    )


def _load_mutated(saved, tmp_path, path, replacement):
    doc = json.loads(json.dumps(saved[0]))
    parent = doc["tree"]
    for part in path[:-1]:
        parent = parent[part]
    if path:
        parent[path[-1]] = replacement
    else:
        doc["tree"] = replacement
    doc.pop("checksum", None)
    d = tmp_path / f"m{random.random()}"
    shutil.copytree(saved[1], d)
    reseal_index(d, index_doc(d)[0], doc)
    state = _objects(seed=1)
    before = {k: v.clone() for k, v in state["model"].state_dict().items()}
    sched_before = dict(state["sched"].state_dict())
    try:
        stashpoint.load(state, d, atomic=True)
    except CheckpointError as e:
        assert all(torch.equal(v, before[k]) for k, v in state["model"].state_dict().items())
        assert state["sched"].state_dict() == sched_before and len(state["optim"].state) == 0
        return e
    finally:
        shutil.rmtree(d)
    return None


@given(st.data())
@settings(max_examples=int(os.environ.get("STASHPOINT_FUZZ_EXAMPLES", "150")), deadline=None)
def test_a_hostile_state_tree_raises_only_checkpoint_errors_and_changes_nothing(saved, tmp_path_factory, data):
    tree = saved[0]["tree"]
    paths = list(_node_paths(tree))
    path = data.draw(st.sampled_from(paths))
    replacement = data.draw(tree_nodes(sorted(saved[2]["tensors"])))
    _load_mutated(saved, tmp_path_factory.mktemp("fz"), path, replacement)


_PARAM_STATE = ("dict", 1, 1, "state", "dict", 0, 1, "dict", 1, 1)  # AdamW's state of its second parameter


@pytest.mark.parametrize(
    "path, replacement",
    [
        (_PARAM_STATE, {"dict": [["a", {"value": 1}]]}),  # no "step": AdamW's own load raises KeyError
        ((*_PARAM_STATE, "dict", 0, 1), {"list": []}),  # "step" a list: float() of it fails
    ],
)
def test_an_atomic_load_that_the_optimizer_itself_refuses_changes_nothing(saved, tmp_path, path, replacement):
    node = saved[0]["tree"]
    for part in _PARAM_STATE:
        node = node[part]
    assert next(k for k, _ in node["dict"]) == "step", node  # the path leads where it says
    refused = _load_mutated(saved, tmp_path, path, replacement)
    assert refused is not None and "into its object failed" in str(refused)


@pytest.mark.parametrize("at", range(5))  # model, optimizer, scheduler, RNGState, sampler
def test_an_object_whose_whole_saved_state_is_none_is_refused_before_anything_changes(saved, tmp_path, at):
    # None stands for "not set yet" inside a state, never for the whole state of an object
    refused = _load_mutated(saved, tmp_path, ("dict", at, 1), {"value": None})
    assert refused is not None


def test_integer_keys_that_python_hashes_alike_are_refused_when_saved_and_loaded(saved, tmp_path):
    alike = [k * ((1 << 61) - 1) for k in range(1, 101)]  # one hash: a dict of N such keys takes N**2 to build
    refused = _load_mutated(saved, tmp_path, ("dict", 5, 1), {"dict": [[k, {"value": 0}] for k in alike]})
    assert refused is not None and "more than 64 integer keys of one hash" in str(refused)
    with pytest.raises(stashpoint.UnsupportedStateError, match=r"the dict under 'ids' holds more than 64 integer"):
        stashpoint.save({"ids": dict.fromkeys(alike, 0)}, tmp_path / "ck")
    # string hashes (most beyond 2**61) and a few that collide by chance are what real keys are
    seen = {hash(f"token-{i}"): i for i in range(1000)} | dict.fromkeys(alike[:64], -1)
    stashpoint.save({"seen": seen}, tmp_path / "ok")
    out = {"seen": {}}
    stashpoint.load(out, tmp_path / "ok")
    assert out["seen"] == seen


def test_a_tree_nested_deeper_than_any_state_is_refused(saved, tmp_path):
    deep: dict = {"value": 1}
    for _ in range(450):
        deep = {"list": [deep]}
    _load_mutated(saved, tmp_path, ("dict", 5, 1), deep)
