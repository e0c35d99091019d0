"""All-or-nothing loads: with atomic=True a load that raises leaves every live tensor, value and object
as it was."""

from __future__ import annotations

import pytest
import torch

import stashpoint


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
        stashpoint.load({"model": fresh, "optim": torch.optim.AdamW(fresh.parameters())}, tmp_path / "c",
                        atomic=atomic)
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
