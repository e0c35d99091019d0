"""Loading an optimizer with many parameters in a group: torch's ``load_state_dict`` asks
``index in group["params"]`` for every state tensor, so stashpoint hands it groups whose
membership test is a set's (quadratic otherwise: 1.4 s at 10k parameters with Adam)."""

from __future__ import annotations

import pytest
import torch

import stashpoint
from stashpoint._load.optimplan import _Members, _members_as_sets


def _model_and_optimizer(n: int, fill: bool) -> tuple[torch.nn.ParameterList, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(8) if fill else torch.zeros(8)) for _ in range(n)])
    params = list(model.parameters())
    optim = torch.optim.AdamW(
        [{"params": params[: n // 2]}, {"params": params[n // 2 :], "lr": 0.5, "weight_decay": 0.0}], lr=1e-3
    )
    if fill:
        for p in params:
            p.grad = torch.randn_like(p)
        optim.step()
    return model, optim


def test_a_fresh_optimizer_of_many_parameters_loads_with_set_membership(tmp_path, monkeypatch):
    model, optim = _model_and_optimizer(2000, fill=True)
    stashpoint.save({"model": model, "optim": optim}, tmp_path / "ckpt")

    seen: list[type] = []
    policy = torch.optim.Optimizer._process_value_according_to_param_policy

    def spy(param, value, param_id, param_groups, key=None):  # type: ignore[no-untyped-def]
        seen.extend(type(g["params"]) for g in param_groups)
        return policy(param, value, param_id, param_groups, key)

    monkeypatch.setattr(torch.optim.Optimizer, "_process_value_according_to_param_policy", staticmethod(spy))
    model2, optim2 = _model_and_optimizer(2000, fill=False)  # a restart: a fresh model and optimizer
    stashpoint.load({"model": model2, "optim": optim2}, tmp_path / "ckpt")

    assert seen and set(seen) == {_Members}  # torch's per-tensor test ran against a set
    for g in optim2.param_groups:  # torch keeps the optimizer's own lists: nothing of ours stays
        assert type(g["params"]) is list
    assert [g["lr"] for g in optim2.param_groups] == [1e-3, 0.5]
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optim.state[p][k], optim2.state[q][k])


def test_members_behave_as_the_list_they_replace():
    sd = {"state": {}, "param_groups": [{"params": [0, 1, 2], "lr": 1.0}, {"params": [], "lr": 2.0}, "odd"]}
    fast = _members_as_sets(sd)
    assert sd["param_groups"][0]["params"].__class__ is list  # the caller's dict as it was
    assert fast["param_groups"][0]["params"] == [0, 1, 2] and 2 in fast["param_groups"][0]["params"]
    assert 3 not in fast["param_groups"][0]["params"] and 0 not in fast["param_groups"][1]["params"]
    assert fast["param_groups"][2] == "odd"
    mixed = _Members([0, [1], "a"])  # something unhashable: a list's test
    assert [1] in mixed and "a" in mixed and 5 not in mixed
    assert [2] not in _Members([0, 1])  # an unhashable query of a hashable list


def test_a_load_pre_hook_is_handed_the_groups_lists_as_they_were(tmp_path):
    """A pre-hook may keep or pickle what it is given: it sees plain lists, as without stashpoint."""
    model, optim = _model_and_optimizer(20, fill=True)
    stashpoint.save({"model": model, "optim": optim}, tmp_path / "ckpt")
    model2, optim2 = _model_and_optimizer(20, fill=False)
    seen: list[type] = []
    optim2.register_load_state_dict_pre_hook(lambda o, sd: seen.extend(type(g["params"]) for g in sd["param_groups"]))
    stashpoint.load({"model": model2, "optim": optim2}, tmp_path / "ckpt")
    assert seen and set(seen) == {list}
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(optim.state[p]["exp_avg"], optim2.state[q]["exp_avg"])


def test_a_fine_tune_with_groups_of_its_own_keeps_their_learning_rates(tmp_path):
    """A pretrained checkpoint of one group loaded with strict=False into a backbone group at
    a low lr and a new head at another: the moments of the parameters both hold load, and
    each group keeps its own hyperparameters. Before: every group took the saved group's lr
    (the backbone trained 100x faster than asked) while the warning said nothing of it."""
    pre = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(pre.parameters(), lr=1e-3, weight_decay=0.1)
    pre(torch.randn(2, 8)).sum().backward()
    opt.step()
    stashpoint.save({"model": pre, "optim": opt}, tmp_path / "pre")
    ft = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
    groups = [{"params": ft[0].parameters(), "lr": 1e-5}, {"params": ft[1].parameters(), "weight_decay": 0.0}]
    opt2 = torch.optim.AdamW(groups, lr=1e-3)
    with pytest.warns(UserWarning, match="its groups keep their own hyperparameters"):
        stashpoint.load({"model": ft, "optim": opt2}, tmp_path / "pre", strict=False)
    assert [(g["lr"], g["weight_decay"]) for g in opt2.param_groups] == [(1e-5, 0.01), (1e-3, 0.0)]
    assert torch.equal(opt2.state[ft[0].weight]["exp_avg"], opt.state[pre[0].weight]["exp_avg"])
    assert ft[1].weight not in opt2.state  # resized: starts fresh


def test_factored_state_is_told_from_a_resized_parameters_state():
    """Factors each collapse one dimension and together two (a factor of the weight's own shape
    collapsing a dimension of one); anything else of another shape is misshapen."""
    from stashpoint._load.optimplan import _misshapen

    def state(*shapes):
        return {f"t{i}": torch.zeros(s) for i, s in enumerate(shapes)}

    fits = [
        ((4, 3), ((4, 1), (1, 3))),  # torch's Adafactor
        ((1, 16), ((1, 1), (1, 16))),  # ... of a weight with a dimension of one
        ((8, 1), ((8, 1), (1, 1))),
        ((4, 3), ((4,), (3,))),  # transformers' Adafactor
        ((4, 3), ((4, 3), (4, 3))),  # Adam
    ]
    for shape, shapes in fits:
        assert _misshapen(state(*shapes), torch.zeros(shape)) is None, (shape, shapes)
    misfits = [
        ((4, 3), ((4, 3), (1, 1))),  # one tensor of the shape lets nothing else through
        ((8,), ((1,), (8,))),  # transformers' Adafactor of a [1, 8] weight, now [8]
        ((4, 8), ((1, 8), (1, 8))),  # Adam of a [1, 8] weight, now [4, 8]
        ((4, 16), ((4, 8), (4, 8))),
    ]
    for shape, shapes in misfits:
        assert _misshapen(state(*shapes), torch.zeros(shape)) is not None, (shape, shapes)


class _TaggedSGD(torch.optim.SGD):
    """An optimizer of a user's own keeping strings in its per-parameter state."""

    def step(self, closure=None):  # type: ignore[no-untyped-def,override]
        super().step(closure)
        for i, p in enumerate(self.param_groups[0]["params"]):
            self.state[p].update(phase=f"warm-{i}", history=["a", "b", 3], n=2)


def _tagged(fill: bool) -> tuple[torch.nn.Module, _TaggedSGD]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optim = _TaggedSGD(model.parameters(), lr=0.1, momentum=0.9)
    if fill:
        model(torch.randn(3, 4)).sum().backward()
        optim.step()
    return model, optim


@pytest.mark.parametrize("with_model", [True, False], ids=["keyed-by-name", "keyed-by-index"])
@pytest.mark.parametrize("atomic", [False, True])
def test_strings_in_an_optimizers_state_come_back_as_saved(tmp_path, with_model, atomic):
    """Torch's own load_state_dict rebuilds a string from a generator (it would come back as
    "<generator object ...>"): the load sets strings apart around it and puts them back."""
    model, optim = _tagged(fill=True)
    state = {"model": model, "optim": optim} if with_model else {"optim": optim}
    stashpoint.save(state, tmp_path / "ckpt")

    model2, optim2 = _tagged(fill=False)  # a restart: a fresh model and optimizer
    state2 = {"model": model2, "optim": optim2} if with_model else {"optim": optim2}
    stashpoint.load(state2, tmp_path / "ckpt", atomic=atomic)

    params, params2 = list(model.parameters()), list(model2.parameters())
    for i, (p, q) in enumerate(zip(params, params2)):
        assert optim2.state[q]["phase"] == f"warm-{i}"
        assert optim2.state[q]["history"] == ["a", "b", 3] and optim2.state[q]["n"] == 2
        assert torch.equal(optim.state[p]["momentum_buffer"], optim2.state[q]["momentum_buffer"])
    assert optim2.state[params2[0]]["history"] is not optim2.state[params2[1]]["history"]


@pytest.mark.parametrize("how", ["own-load", "pre-hook", "post-hook"])
def test_strings_for_a_load_that_is_not_torchs_alone_are_refused_not_garbled(tmp_path, how):
    """An optimizer whose own load_state_dict calls torch's, or one with load hooks, would see
    (or be handed) the strings before they are put back: torch's load garbles them there, so the
    load refuses them, as it did before strings were set apart. A string beside a tensor in one
    list is refused too (torch's load moves the tensor and garbles the string)."""

    class OwnLoad(_TaggedSGD):
        def load_state_dict(self, state_dict):  # type: ignore[no-untyped-def,override]
            super().load_state_dict(state_dict)

    model, optim = _tagged(fill=True)
    stashpoint.save({"model": model, "optim": optim}, tmp_path / "ck")
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optim2 = (OwnLoad if how == "own-load" else _TaggedSGD)(model2.parameters(), lr=0.1, momentum=0.9)
    if how == "pre-hook":
        optim2.register_load_state_dict_pre_hook(lambda opt, sd: sd)
    elif how == "post-hook":
        optim2.register_load_state_dict_post_hook(lambda opt: None)
    with pytest.raises(stashpoint.StateMismatchError, match="holds a string, which torch's load_state_dict"):
        stashpoint.load({"model": model2, "optim": optim2}, tmp_path / "ck")
    stashpoint.load({"model": model2, "optim": optim2}, tmp_path / "ck", strict=False)  # the model loads
    assert torch.equal(model2[0].weight, model[0].weight) and not optim2.state

    optim.state[next(iter(model.parameters()))]["mixed"] = ["a", torch.ones(1)]
    stashpoint.save({"model": model, "optim": optim}, tmp_path / "mixed")
    model3, optim3 = _tagged(fill=False)
    with pytest.raises(stashpoint.StateMismatchError, match=r"'mixed' of parameter .* mixes strings and tensors"):
        stashpoint.load({"model": model3, "optim": optim3}, tmp_path / "mixed")
