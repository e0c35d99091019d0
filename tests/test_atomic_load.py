"""All-or-nothing loads: with atomic=True a load that raises leaves every live tensor, value and object
as it was (but for an object's own load_state_dict, which runs last: the error says so)."""

from __future__ import annotations

import pytest
import torch

import stashpoint
from stashpoint.errors import CheckpointError


def _damage(path, key_bytes: bytes) -> None:
    """Flip a byte inside the data of the tensor whose bytes start with ``key_bytes``."""
    shard = next(p for p in path.iterdir() if p.name.startswith("shard-"))
    data = bytearray(shard.read_bytes())
    at = data.rindex(key_bytes)
    data[at + 1] ^= 0xFF
    shard.write_bytes(bytes(data))


def _trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optim.step()
    return model, optim


def test_a_load_that_finds_damage_leaves_the_whole_state_as_it_was(tmp_path):
    model, optim = _trained()
    last = torch.full((4096,), 7.0)
    stashpoint.save({"model": model, "optim": optim, "step": 5, "last": last}, tmp_path / "c")
    _damage(tmp_path / "c", last.numpy().tobytes()[:64])  # the last tensor written: the others read first

    fresh, fresh_optim = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)), None
    fresh_optim = torch.optim.AdamW(fresh.parameters())
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    state = {"model": fresh, "optim": fresh_optim, "step": 0, "last": torch.zeros(4096)}
    with pytest.raises(stashpoint.CorruptCheckpointError, match="'last'"):
        stashpoint.load(state, tmp_path / "c", atomic=True)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    assert state["step"] == 0 and torch.equal(state["last"], torch.zeros(4096))
    assert len(fresh_optim.state) == 0

    # without atomic (the default, for speed) the tensors read before the damaged one are loaded,
    # and the error says so
    with pytest.raises(stashpoint.CorruptCheckpointError, match="may already hold this checkpoint's values"):
        stashpoint.load(state, tmp_path / "c")
    assert state["step"] == 0
    assert any(not torch.equal(v, before[k]) for k, v in fresh.state_dict().items())


def test_an_intact_checkpoint_loads_the_same_either_way(tmp_path):
    model, optim = _trained()
    stashpoint.save({"model": model, "optim": optim}, tmp_path / "c")
    for atomic in (True, False):
        fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
        stashpoint.load({"model": fresh, "optim": torch.optim.AdamW(fresh.parameters())}, tmp_path / "c", atomic=atomic)
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())


def test_an_atomic_loads_trial_of_the_optimizer_runs_none_of_its_hooks_twice(tmp_path):
    """The trial on a copy (which finds an optimizer refusing its state before anything lands) is
    for torch's own load_state_dict without hooks: a hook would run twice (an lr halved twice)."""
    model = torch.nn.Linear(4, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    stashpoint.save({"model": model, "optim": optim}, tmp_path / "c")
    calls = []

    def halve(opt, sd):
        calls.append(opt)
        for g in sd["param_groups"]:
            g["lr"] /= 2

    fresh = torch.optim.AdamW(model.parameters(), lr=0.01)
    fresh.register_load_state_dict_pre_hook(halve)
    stashpoint.load({"model": model, "optim": fresh}, tmp_path / "c", atomic=True)
    assert calls == [fresh] and fresh.param_groups[0]["lr"] == 0.005


class _Warmup:
    """A callable LR factor with state of its own: LambdaLR saves and loads its attributes."""

    def __init__(self, steps: int) -> None:
        self.steps, self.calls = steps, 0

    def __call__(self, epoch: int) -> float:
        self.calls += 1
        return min(1.0, (epoch + 1) / self.steps)


_SCHEDULERS = {
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, _Warmup(5)),
    "sequential": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.LambdaLR(o, _Warmup(3)), torch.optim.lr_scheduler.StepLR(o, 2)], milestones=[3]
    ),
    "plateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0),
    "cyclic": lambda o: torch.optim.lr_scheduler.CyclicLR(o, 0.001, 0.1, scale_fn=_Warmup(4), cycle_momentum=False),
}


def _scheduled(kind: str, seed: int, steps: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 8)
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = _SCHEDULERS[kind](optim)
    for i in range(steps):
        model(torch.randn(2, 8)).sum().backward()
        optim.step()
        sched.step(float(10 - i)) if kind == "plateau" else sched.step()
    return {"model": model, "optim": optim, "sched": sched}


@pytest.mark.parametrize("kind", sorted(_SCHEDULERS))
def test_an_atomic_load_of_each_torch_scheduler_gives_the_state_it_saved(tmp_path, kind):
    """The trial on a copy (LambdaLR pops a key from the state it loads, SequentialLR loads its inner
    schedulers, CyclicLR and LambdaLR update their callables) leaves the real load whole."""
    saved = _scheduled(kind, 0, 4)
    stashpoint.save(saved, tmp_path / "c")
    fresh = _scheduled(kind, 1, 0)
    stashpoint.load(fresh, tmp_path / "c", atomic=True)
    assert str(fresh["sched"].state_dict()) == str(saved["sched"].state_dict())
    assert fresh["sched"].optimizer is fresh["optim"]  # the live scheduler, not a copy, was loaded
    lr = [g["lr"] for g in saved["optim"].param_groups]
    assert [g["lr"] for g in fresh["optim"].param_groups] == lr


@pytest.mark.parametrize(
    "kind, key",
    [("lambda", "lr_lambdas"), ("sequential", "_schedulers"), ("plateau", "mode")],
)
def test_a_scheduler_that_refuses_its_saved_state_fails_an_atomic_load_before_anything_changes(tmp_path, kind, key):
    """A re-sealed checkpoint whose scheduler state passes the planner's checks (None matches
    anything inside a state) but which the scheduler's own load_state_dict refuses: before, the
    model's tensors had landed when it raised."""
    from conftest import index_doc, reseal_index

    stashpoint.save(_scheduled(kind, 0, 4), tmp_path / "c")
    path, doc = index_doc(tmp_path / "c")
    sched = next(node for k, node in doc["tree"]["dict"] if k == "sched")["state"]
    pair = next(kv for kv in sched["dict"] if kv[0] == key)
    pair[1] = {"value": None}
    reseal_index(tmp_path / "c", path, doc)

    fresh = _scheduled(kind, 1, 0)
    before = {k: v.clone() for k, v in fresh["model"].state_dict().items()}
    sched_before = str(fresh["sched"].state_dict())
    with pytest.raises(stashpoint.CheckpointError, match=r"'sched'.* into its object failed"):
        stashpoint.load(fresh, tmp_path / "c", atomic=True)
    assert all(torch.equal(v, before[k]) for k, v in fresh["model"].state_dict().items())
    assert str(fresh["sched"].state_dict()) == sched_before and len(fresh["optim"].state) == 0


class _RefusesTwo:
    def __init__(self, v: int = 0) -> None:
        self.v = v

    def state_dict(self) -> dict:
        return {"v": self.v}

    def load_state_dict(self, sd: dict) -> None:
        if sd["v"] == 2:
            raise RuntimeError("cannot take v=2")
        self.v = sd["v"]


def test_an_objects_own_load_that_raises_says_what_an_atomic_load_changed_already(tmp_path):
    """An object's own load_state_dict cannot be tried on a copy: it runs last. Before, the error
    named the object alone, and atomic=True's docstring promised a state left as it was."""
    stashpoint.save({"w": torch.full((4,), 2.0), "n": 2, "obj": _RefusesTwo(2)}, tmp_path / "ck")
    state = {"w": torch.zeros(4), "n": 0, "obj": _RefusesTwo()}
    with pytest.raises(CheckpointError) as e:
        stashpoint.load(state, tmp_path / "ck", atomic=True)
    assert "cannot take v=2" in str(e.value) and "The objects' own loads run last" in str(e.value)
    assert "tensors and plain values hold this checkpoint's values already" in str(e.value)
    assert state["w"][0] == 2.0 and state["n"] == 2 and state["obj"].v == 0  # as the message says
