"""The public API's arguments: a wrong type or a value out of range is refused at the call,
naming the argument, before anything is written (before: NaN or infinite timeouts broke a
distributed save and hung the next, max_inflight=nan hung the save, allow_pickle="False"
unpickled, a sampler took a seed its own load refused, ...)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import stashpoint

STATE = {"w": torch.ones(4)}
BAD_SECONDS = [math.nan, math.inf, -1, 0, "1", True]


@pytest.mark.parametrize("timeout", BAD_SECONDS)
def test_a_timeout_that_is_no_finite_positive_number_is_refused(tmp_path, timeout):
    with pytest.raises(ValueError, match=r"timeout must be None or a finite number of seconds above 0"):
        stashpoint.save(STATE, tmp_path / "ck", timeout=timeout)
    assert not (tmp_path / "ck").exists()
    stashpoint.save(STATE, tmp_path / "ok")
    with pytest.raises(ValueError, match=r"timeout must be"):
        stashpoint.load({"w": torch.zeros(4)}, tmp_path / "ok", timeout=timeout)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        *[("max_inflight", v) for v in (math.nan, 1.5, "3", None, True)],
        *[("max_shard_bytes", v) for v in ("1", 1.5, math.inf)],
    ],
)
def test_counts_that_are_no_positive_integer_are_refused(tmp_path, option, value):
    """max_inflight (a manager's) nan: its save hung; 1.5: close() failed; max_shard_bytes inf:
    taken, one shard file."""
    if option == "max_inflight":
        with pytest.raises(ValueError, match=r"max_inflight must be"):
            stashpoint.CheckpointManager(tmp_path / "run", max_inflight=value)
        return
    with pytest.raises(ValueError, match=rf"{option} must be"):
        stashpoint.async_save(STATE, tmp_path / "ck", **{option: value})
    assert not (tmp_path / "ck").exists()


def test_yes_no_options_must_be_bools(tmp_path):
    for option in ("allow_pickle", "overwrite", "overlap"):
        with pytest.raises(TypeError, match=rf"{option} must be True or False, got 'no'"):
            stashpoint.save(STATE, tmp_path / "ck", **{option: "no"})
    stashpoint.save(STATE, tmp_path / "ok")
    for option in ("strict", "partial", "verify", "atomic", "allow_pickle"):
        with pytest.raises(TypeError, match=rf"{option} must be True or False"):
            stashpoint.load({"w": torch.zeros(4)}, tmp_path / "ok", **{option: "False"})
    with pytest.raises(TypeError, match=r"allow_pickle must be True or False, got 'False'"):
        stashpoint.read(tmp_path / "ok", allow_pickle="False")  # it was true: unpickled
    with pytest.raises(TypeError, match=r"select must be a key path"):
        stashpoint.read(tmp_path / "ok", select=5)
    with pytest.raises(TypeError, match=r"node_local must be True or False"):
        stashpoint.CheckpointManager(tmp_path / "run", node_local="yes")


def test_a_managers_replicas_deadline_steps_and_metadata_are_checked(tmp_path):
    for replicas in (-1, 1.5, None, True):
        with pytest.raises(ValueError, match=r"replicas must be a whole number of copies"):
            stashpoint.CheckpointManager(tmp_path / "run", replicas=replicas)
    for deadline in (math.inf, math.nan, True, "3", 0):
        with pytest.raises(ValueError, match=r"preemption_deadline must be"):
            stashpoint.CheckpointManager(tmp_path / "run", preemption_deadline=deadline)
    with stashpoint.CheckpointManager(tmp_path / "run", every_steps=2) as mgr:
        for bad in (1.5, "3"):
            with pytest.raises((TypeError, ValueError), match=r"step"):
                mgr.path(bad)
            with pytest.raises((TypeError, ValueError), match=r"step"):
                mgr.should_save(bad)
        with pytest.raises(ValueError, match=r"'stashpoint.metrics' is the manager's own"):
            mgr.save(1, STATE, metadata={"stashpoint.metrics": "mine"})
        mgr.save(2, STATE, metrics={"loss": 1.0}).wait()

        def listing() -> list[int]:
            raise AssertionError("repr listed the storage")

        mgr.steps = listing  # type: ignore[method-assign]
        assert repr(mgr) == f"<CheckpointManager {mgr.root}>"


def test_a_sampler_refuses_what_its_load_would_refuse_and_takes_numpy_integers(tmp_path):
    from stashpoint import StatefulSampler

    for kwargs, error in [
        ({"seed": -1}, ValueError),
        ({"seed": 2**62}, ValueError),
        ({"seed": 1.5}, TypeError),
        ({"shuffle": 0}, TypeError),
        ({"rank": "0", "world_size": 2}, TypeError),
    ]:
        with pytest.raises(error, match=r"StatefulSampler's|shuffle must be"):
            StatefulSampler(10, **kwargs)
    sampler = StatefulSampler(10)
    with pytest.raises(ValueError, match=r"epoch must be from 0"):
        sampler.set_epoch(-1)
    with pytest.raises(TypeError, match=r"batches must be an integer"):
        sampler.seek(2.5, 4)
    numpy_made = StatefulSampler(np.int64(10), seed=np.int64(3), rank=np.int64(0), world_size=np.int64(1))
    numpy_made.set_epoch(np.int64(1))
    stashpoint.save({"s": numpy_made}, tmp_path / "ck")  # before: numpy.int64 at key 's/seed' refused
    back = StatefulSampler(10, seed=3)
    stashpoint.load({"s": back}, tmp_path / "ck")
    assert back.state_dict() == numpy_made.state_dict() and back.epoch == 1


def test_the_lightning_plugin_refuses_bad_options_when_made(tmp_path):
    from stashpoint.integrations.lightning import StashpointCheckpointIO

    for kwargs in ({"writer": "bogus"}, {"max_shard_bytes": 0}, {"metadata": {"a": 1}}, {"timeout": -1}):
        with pytest.raises((TypeError, ValueError)):
            StashpointCheckpointIO(**kwargs)


def test_keep_best_metrics_signals_and_a_handles_timeout_are_named(tmp_path):
    for k in (0, True, 1.5):
        with pytest.raises(ValueError, match=r"keep_best's k \(how many best steps to keep\) must be"):
            stashpoint.CheckpointManager(tmp_path / "run", keep_best=(k, "loss"))
    stashpoint.CheckpointManager(tmp_path / "run", keep_best=(np.int64(2), "loss")).close()  # as keep_last takes
    for signals in (15, "SIGTERM"):
        with pytest.raises(TypeError, match=r"preemption_signals must be a sequence of signals"):
            stashpoint.CheckpointManager(tmp_path / "run", preemption_deadline=5, preemption_signals=signals)
    with stashpoint.CheckpointManager(tmp_path / "run") as mgr:
        for metrics in ([("loss", 1.0)], 5):
            with pytest.raises(TypeError, match=r"metrics must be a dict of names to numbers"):
                mgr.save(1, STATE, metrics=metrics)
        handle = mgr.save(1, STATE)
        with pytest.raises(ValueError, match=r"timeout must be None or a finite number of seconds 0 or more"):
            handle.wait(timeout="1")
        handle.wait()


def test_a_managers_save_refused_for_its_options_moves_nothing_aside(tmp_path):
    """Before: the checks ran after the steps above a restored one were moved aside, and a
    timeout of inf reached the ranks' collectives first (a distributed save failed, the next hung)."""
    with stashpoint.CheckpointManager(tmp_path / "run", keep_last=None) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, STATE).wait()
        mgr.restore({"w": torch.zeros(4)}, 1)
        for options in ({"metadata": {"stashpoint.metrics": "{}"}}, {"timeout": math.inf}, {"allow_pickle": "no"}):
            with pytest.raises((TypeError, ValueError)):
                mgr.save(2, STATE, **options)
        assert mgr.steps() == [1, 2, 3]
        with pytest.raises(ValueError, match=r"timeout must be"):
            mgr.restore({"w": torch.zeros(4)}, 1, timeout=math.nan)
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("step")) == [
        "step-00000001",
        "step-00000002",
        "step-00000003",
    ]


def test_a_sampler_over_an_array_or_a_tensor_counts_its_length():
    from stashpoint import StatefulSampler

    assert StatefulSampler(np.arange(100)).num_samples == 100  # NumPy arrays and tensors have __index__ too
    assert StatefulSampler(torch.arange(100)).num_samples == 100
    assert StatefulSampler(torch.tensor([7])).num_samples == 1
