"""Property tests for the manager's pure policies."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stashpoint._core.naming import parse_step_dir, step_dir
from stashpoint._core.policy import Doubling, Retention, Schedule, metric_problem, steps_to_keep

steps_st = st.lists(st.integers(0, 500), max_size=30, unique=True)
opt = st.none() | st.integers(1, 6)
policies = st.builds(
    Retention,
    keep_last=opt,
    keep_every=opt,
    keep_best=opt,
    metric=st.just("loss"),
    mode=st.sampled_from(["min", "max"]),
)
metrics_st = st.dictionaries(st.integers(0, 500), st.fixed_dictionaries({"loss": st.floats(-10, 10)}))


@given(steps_st, metrics_st, policies)
def test_retention_keeps_exactly_the_union_of_its_rules(steps, metrics, policy):
    keep = steps_to_keep(steps, metrics, policy)
    assert keep <= set(steps)
    if not steps:
        return
    ordered = sorted(steps)
    assert ordered[-1] in keep, "the newest step is never deleted"
    if policy.keeps_all:
        assert keep == set(steps)
        return
    expected = {ordered[-1]}
    if policy.keep_last:
        expected |= set(ordered[-policy.keep_last :])
    if policy.keep_every:
        expected |= {s for s in steps if s % policy.keep_every == 0}
    if policy.keep_best:
        scored = [s for s in steps if s in metrics]
        sign = 1 if policy.mode == "min" else -1
        best = sorted(scored, key=lambda s: (sign * metrics[s]["loss"], -s))[: policy.keep_best]
        expected |= set(best)
        # nothing outside the best k scores better than the worst kept one
        if best:
            worst = max(sign * metrics[s]["loss"] for s in best)
            assert all(sign * metrics[s]["loss"] >= worst for s in scored if s not in best)
    assert keep == expected


@given(steps_st, metrics_st, policies)
def test_retention_is_idempotent(steps, metrics, policy):
    keep = steps_to_keep(steps, metrics, policy)
    assert steps_to_keep(sorted(keep), metrics, policy) == keep


@given(st.integers(0, 10**12))
def test_step_dir_round_trips_and_sorts(step):
    assert parse_step_dir(step_dir(step)) == step
    assert step_dir(step).startswith("step-")


def test_step_dir_rejects_foreign_names():
    assert parse_step_dir("step-12") is None  # too short to be ours
    assert parse_step_dir("step-00000012.tmp") is None
    assert parse_step_dir("other") is None
    with pytest.raises(ValueError, match="non-negative"):
        step_dir(-1)


def test_schedule():
    s = Schedule(every_steps=10)
    assert [x for x in range(1, 31) if s.due(x, 0.0, None)] == [10, 20, 30]
    t = Schedule(every_seconds=5)
    assert t.due(1, 100.0, None) and not t.due(2, 103.0, 100.0) and t.due(3, 105.0, 100.0)
    both = Schedule(every_steps=100, every_seconds=60)
    assert both.due(100, 1.0, 0.5) and both.due(7, 61.0, 0.5) and not both.due(7, 2.0, 0.5)
    with pytest.raises(ValueError):
        Schedule(every_steps=0)
    with pytest.raises(ValueError, match="keep_last"):
        Retention(keep_last=0)
    with pytest.raises(ValueError, match="mode"):
        Retention(mode="median")


def test_metric_values_that_are_no_finite_number_do_not_compete():
    """Read from any manifest: an integer too large for a float, a boolean, a string, NaN
    and infinity are passed by, never raised on (an OverflowError here stopped the retention)."""
    metrics = {1: {"loss": 10**400}, 2: {"loss": True}, 3: {"loss": "low"}, 4: {"loss": float("nan")}}
    metrics |= {5: {"loss": float("-inf")}, 6: {"loss": 0.5}, 7: {"loss": 2}}
    for mode, best in (("min", 6), ("max", 7)):
        policy = Retention(keep_last=1, keep_best=1, metric="loss", mode=mode)
        assert steps_to_keep(list(range(1, 9)), metrics, policy) == {8, best}


def test_options_that_are_no_count_or_no_finite_time_are_refused_by_name():
    """Before: every_steps=2.5 and True, keep_last=True and every_seconds=inf were taken (as a
    step count of 2.5, as 1, and a schedule that never saves); "10" raised a bare TypeError."""
    for name, value in (("every_steps", 2.5), ("every_steps", True), ("every_steps", "10"), ("every_steps", 0)):
        with pytest.raises(ValueError, match=f"{name} must be None or a positive integer, got {value!r}"):
            Schedule(**{name: value})
    for value in (float("inf"), float("nan"), True, "5", 0, -1.0):
        with pytest.raises(ValueError, match="every_seconds must be None or a positive, finite number"):
            Schedule(every_seconds=value)
    for name in ("keep_last", "keep_every", "keep_best"):
        with pytest.raises(ValueError, match=f"{name} must be None or a positive integer, got True"):
            Retention(**{name: True})
    import numpy as np

    assert Schedule(every_steps=np.int64(3), every_seconds=0.5).due(6, 0.0, 0.0)
    assert steps_to_keep([1, 2, 3], {}, Retention(keep_last=np.int64(2))) == {2, 3}


def test_a_save_whose_metrics_cannot_compete_for_keep_best_is_told_apart_from_one_with_none():
    best = Retention(keep_last=1, keep_best=2, metric="val_loss")
    assert metric_problem({}, best) is None, "no metrics: documented not to compete"
    assert metric_problem({"val_loss": 0.3, "acc": 1}, best) is None
    kind, text = metric_problem({"valloss": 0.3}, best)  # type: ignore[misc]
    assert kind == "missing" and "'val_loss'" in text and "'valloss'" in text
    for bad in (float("nan"), float("-inf"), "0.1", True, None, 10**400):
        kind, text = metric_problem({"val_loss": bad}, best)  # type: ignore[misc]
        assert kind == "value" and "not a finite number" in text
    assert metric_problem({"valloss": 0.3}, Retention(keep_last=1)) is None, "no keep_best: nothing to say"


def test_a_growing_count_is_said_past_its_mark_at_each_doubling_and_afresh_after_falling_back():
    said = Doubling(3)
    counts = [1, 2, 3, 4, 3, 4, 5, 8, 9, 4, 1, 2, 4]
    assert [c for c in counts if said.louder(c)] == [4, 9, 4]
