"""The layout cache: a remembered layout is the one worked out afresh, whatever changed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import stashpoint
from stashpoint._save import engine as _save
from stashpoint._save.layout import Layout, LayoutCache
from stashpoint.errors import UnsupportedStateError


def _same(a: Layout, b: Layout) -> None:
    assert a.chunks == b.chunks
    assert a.aliases == b.aliases
    assert a.keyinfo == b.keyinfo
    assert a.hash == b.hash
    assert a.signatures == b.signatures
    assert a.key_of == b.key_of
    assert a.sources.keys() == b.sources.keys()
    for k, src in a.sources.items():
        other = b.sources[k]
        assert (src.data_ptr(), src.shape, src.stride(), src.dtype) == (
            other.data_ptr(),
            other.shape,
            other.stride(),
            other.dtype,
        ), k
        assert not src.requires_grad


# Each state is a few keys drawn from a pool of tensors and views of them: shared storage (tied
# keys), views at offsets, transposes, dtype views, parameters, empty tensors.
_POOL_SIZE = 5


def _pool() -> list[torch.Tensor]:
    base = torch.arange(48, dtype=torch.float32)
    p = torch.nn.Parameter(torch.ones(4, 3))
    return [base, base[8:20].view(3, 4), base[:12].view(3, 4).t(), p, torch.empty(0)]


def _variant(t: torch.Tensor, how: int) -> torch.Tensor:
    if how == 0:
        return t
    if how == 1:
        return t.detach()  # another object, the same bytes
    if how == 2:
        return t.detach().clone()  # the same shape, other bytes
    return t.detach().view(torch.int32) if t.dtype == torch.float32 and t.is_contiguous() else t


_STATES = st.lists(
    st.lists(st.tuples(st.integers(0, _POOL_SIZE - 1), st.integers(0, 3)), min_size=1, max_size=5),
    min_size=1,
    max_size=6,
)


@settings(max_examples=150, deadline=None)
@given(_STATES)
def test_a_remembered_layout_equals_one_worked_out_afresh(states):
    pool = _pool()
    cache = LayoutCache(size=2)
    for picks in states:
        tensors = [(f"k{i}", _variant(pool[j], how)) for i, (j, how) in enumerate(picks)]
        _same(cache(tensors), Layout.of(tensors))


def test_changes_between_saves_are_seen(tmp_path):
    """Re-saving a state reuses its layout; replacing a tensor's memory, tying two tensors or
    changing a shape is a new layout, and every checkpoint loads back what was saved."""
    a, b = torch.randn(64), torch.randn(64)
    state = {"a": a, "b": b, "n": 0}
    engine = _save.get_engine()
    before = engine.layouts.hits

    def roundtrip(name: str) -> None:
        stashpoint.save(state, tmp_path / name)
        back = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        stashpoint.load(back, tmp_path / name)
        for k, v in state.items():
            assert torch.equal(back[k], v) if isinstance(v, torch.Tensor) else back[k] == v, (name, k)

    roundtrip("first")
    state["n"] = 1
    a.add_(1)
    roundtrip("same-structure")
    assert engine.layouts.hits == before + 1, "the unchanged structure's layout was remembered"
    state["b"] = state["a"]  # tied: stored once
    roundtrip("tied")
    report = stashpoint.verify(tmp_path / "tied")
    assert report.problems == [] and report.bytes_checked == 64 * 4, "the tied pair is stored once"
    state["b"] = torch.randn(8, 8)  # another shape
    roundtrip("reshaped")
    state["a"] = torch.randn(64).to(torch.float64)
    roundtrip("retyped")


def test_a_refused_tensor_is_refused_after_a_remembered_layout(tmp_path):
    state = {"x": torch.ones(3)}
    stashpoint.save(state, tmp_path / "a")
    stashpoint.save(state, tmp_path / "b")
    state["x"] = torch.ones(3).to_sparse()
    with pytest.raises(UnsupportedStateError, match=r"layout torch\.sparse_coo at key 'x'"):
        stashpoint.save(state, tmp_path / "c")
    state["x"] = torch.zeros(3, device="meta")
    with pytest.raises(UnsupportedStateError, match="meta tensor at key 'x'"):
        stashpoint.save(state, tmp_path / "d")


def test_no_tensor_of_a_saved_state_is_kept_alive(tmp_path):
    import gc
    import weakref

    state = {"w": torch.randn(1000), "m": torch.nn.Linear(4, 4)}
    stashpoint.save(state, tmp_path / "a")
    stashpoint.save(state, tmp_path / "b")  # a remembered layout
    refs = [weakref.ref(state["w"]), weakref.ref(state["m"].weight)]
    del state
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_a_module_with_its_own_state_dict_is_asked_without_keep_vars(tmp_path):
    m = torch.nn.Linear(3, 3)
    m.state_dict = lambda: {"w": m.weight.detach() * 0 + 7}  # an instance's own, without keep_vars
    stashpoint.save({"m": m}, tmp_path / "ck")
    from safetensors import safe_open

    (shard,) = tmp_path.joinpath("ck").glob("shard-*.safetensors")
    with safe_open(str(shard), "pt") as f:
        assert list(f.keys()) == ["m/w"] and torch.equal(f.get_tensor("m/w"), torch.full((3, 3), 7.0))
