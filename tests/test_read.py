"""stashpoint.read: a checkpoint as plain values, without a live state to load into."""

from __future__ import annotations

import pytest
import torch

import stashpoint


def _state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 4))
    model[2].weight = torch.nn.Parameter(model[0].weight.t().contiguous())
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    optim.step()
    return model, optim


def test_read_returns_the_saved_state_as_plain_values(tmp_path):
    model, optim = _state()
    tied = torch.arange(6.0)
    stashpoint.save({"model": model, "optim": optim, "step": 3, "meta": {"name": "run", "tied": [tied, tied[:]]}},
                    tmp_path / "c")
    out = stashpoint.read(tmp_path / "c")
    assert out["step"] == 3 and out["meta"]["name"] == "run"
    for k, v in model.state_dict().items():
        assert torch.equal(out["model"][k], v), k
    assert out["model"]["1.num_batches_tracked"].dtype == torch.int64
    osd = optim.state_dict()
    names = [n for n, _ in model.named_parameters()]
    for i, n in enumerate(names):
        for s in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(out["optim"]["state"][n][s], osd["state"][i][s]), (n, s)
    assert out["optim"]["param_groups"][0]["params"] == names
    a, b = out["meta"]["tied"]
    assert a is b and torch.equal(a, tied)  # stored once, read once


def test_select_reads_one_subtree_and_a_wrong_key_names_the_keys_there(tmp_path):
    model, optim = _state()
    stashpoint.save({"model": model, "optim": optim}, tmp_path / "c")
    weights = stashpoint.read(tmp_path / "c", select="model")
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 4))
    fresh.load_state_dict(weights)
    assert torch.equal(fresh[0].weight, model[0].weight)
    moments = stashpoint.read(tmp_path / "c", select="optim/state/0.weight")
    assert set(moments) == {"exp_avg", "exp_avg_sq", "step"}
    assert torch.equal(stashpoint.read(tmp_path / "c", select="model/0.bias"), model[0].bias)
    with pytest.raises(stashpoint.CheckpointError, match=r"no key 'optim/stat'.*'state', 'param_groups'"):
        stashpoint.read(tmp_path / "c", select="optim/stat")


def test_read_verifies_checksums_and_never_unpickles_unless_allowed(tmp_path):
    stashpoint.save({"w": torch.ones(1000), "obj": {1, 2}}, tmp_path / "c", allow_pickle=True)
    with pytest.raises(stashpoint.CheckpointError, match="pickled"):
        stashpoint.read(tmp_path / "c")
    assert stashpoint.read(tmp_path / "c", allow_pickle=True)["obj"] == {1, 2}
    assert torch.equal(stashpoint.read(tmp_path / "c", select="w"), torch.ones(1000))
    shard = next(p for p in (tmp_path / "c").iterdir() if p.name.startswith("shard-"))
    data = bytearray(shard.read_bytes())
    data[-7] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(stashpoint.CorruptCheckpointError):
        stashpoint.read(tmp_path / "c", select="w")
    with pytest.raises(stashpoint.CheckpointNotFoundError):
        stashpoint.read(tmp_path / "missing")


def test_a_rank_the_checkpoint_has_not_is_refused_by_number(tmp_path):
    stashpoint.save({"step": 1}, tmp_path / "c")
    assert stashpoint.read(tmp_path / "c", rank=0) == {"step": 1}
    assert stashpoint.read(tmp_path / "c", rank=torch.tensor(0)) == {"step": 1}  # any integer type
    for rank in (1, 9, -1):
        with pytest.raises(ValueError, match=rf"rank {rank} is out of range: .* saved by 1 rank"):
            stashpoint.read(tmp_path / "c", rank=rank)
    with pytest.raises(TypeError, match="rank must be an int, not str"):
        stashpoint.read(tmp_path / "c", rank="0")
