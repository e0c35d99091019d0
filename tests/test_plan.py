"""Property tests for the pure planning functions."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from stashpoint._core.naming import shard_name
from stashpoint._core.plan import TensorSpec, group_aliases, plan_files

specs_st = st.lists(
    st.builds(
        TensorSpec,
        key=st.uuids().map(str),
        dtype=st.just("x"),
        shape=st.lists(st.integers(0, 40), max_size=3).map(tuple),
        itemsize=st.sampled_from([1, 2, 4, 8, 16]),
    ),
    max_size=40,
    unique_by=lambda s: s.key,
)


@given(specs_st, st.integers(1, 5000))
@settings(max_examples=300, deadline=None)
def test_plan_covers_every_tensor_aligned_and_gap_free(specs, limit):
    plan = plan_files(specs, max_file_bytes=limit)
    placed = [p for f in plan.files for p in f.placements]
    assert sorted(p.key for p in placed) == sorted(s.key for s in specs)
    by_key = {s.key: s for s in specs}
    for f in plan.files:
        offset = 0
        for p in f.placements:
            spec = by_key[p.key]
            assert p.begin == offset, "the safetensors data section must be gap-free"
            assert p.end - p.begin == spec.nbytes
            assert p.begin % spec.itemsize == 0, "each tensor starts aligned to its element size"
            offset = p.end
        assert f.data_size == offset
        # a file exceeds the limit only when it holds a single oversized tensor
        assert f.data_size <= limit or len(f.placements) == 1
    assert [f.index for f in plan.files] == list(range(len(plan.files)))


@given(st.lists(st.one_of(st.none(), st.integers(0, 5))))
def test_group_aliases_points_to_first_occurrence(sigs):
    out = group_aliases(sigs)
    for i, (sig, first) in enumerate(zip(sigs, out)):
        if sig is None:
            assert first is None
        elif first is None:
            assert sig not in sigs[:i]
        else:
            assert first < i and sigs[first] == sig and sig not in sigs[:first]


def test_plan_is_deterministic_and_names_are_stable():
    specs = [TensorSpec("a", "float32", (3,), 4), TensorSpec("b", "float64", (2,), 8)]
    assert plan_files(specs, max_file_bytes=100) == plan_files(list(specs), max_file_bytes=100)
    assert [p.key for p in plan_files(specs, max_file_bytes=100).files[0].placements] == ["b", "a"]
    assert shard_name(3, 7, "abc") == "shard-r00003-0007-abc.safetensors"
