"""The names an optimizer's state is saved under where several modules of the state hold one
parameter (a model and its head, listed side by side): the first module in the state's order
names it, and a resume that lists them in another order still finds each parameter's state."""

from __future__ import annotations

import warnings

import pytest
import torch

import stashpoint


class _WithHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(3))  # named "weight", as the head's own is in the head
        self.head = torch.nn.Linear(3, 3, bias=False)


def _trained(head_first: bool) -> tuple[dict, _WithHead, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = _WithHead()
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    state = {"head": m.head, "model": m, "opt": opt} if head_first else {"model": m, "head": m.head, "opt": opt}
    return state, m, opt


def _step(m: _WithHead, opt: torch.optim.Optimizer) -> None:
    (m.weight.sum() * 3 + m.head.weight.sum() * 7).backward()
    opt.step()
    opt.zero_grad()


def test_a_head_listed_before_the_model_that_holds_it_finds_its_optimizer_state(tmp_path):
    """Before: 'unexpected optimizer parameter head.weight', the head's weight named 'weight'."""
    state, m, opt = _trained(head_first=False)
    _step(m, opt)
    _step(m, opt)
    stashpoint.save(state, tmp_path / "c")
    for head_first in (False, True):
        fresh, m2, opt2 = _trained(head_first)  # a restart: fresh model and optimizer
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing to warn about: each parameter has one name saved
            stashpoint.load(fresh, tmp_path / "c")
        for p, q in ((m.weight, m2.weight), (m.head.weight, m2.head.weight)):
            assert torch.equal(opt.state[p]["exp_avg"], opt2.state[q]["exp_avg"])
        _step(m, opt)
        _step(m2, opt2)
        assert torch.equal(m.head.weight, m2.head.weight) and torch.equal(m.weight, m2.weight)
        stashpoint.load(state, tmp_path / "c")  # back as saved for the next round


def test_two_modules_naming_each_others_layers_warn_that_their_order_decides(tmp_path):
    """Two containers hold the same layers under swapped names: only the state's order tells
    which saved state is whose; before, another order swapped the moments without a word."""

    def build(xy: bool):
        torch.manual_seed(0)
        l1, l2 = torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 2, bias=False)
        x, y = torch.nn.ModuleDict({"a": l1, "b": l2}), torch.nn.ModuleDict({"a": l2, "b": l1})
        opt = torch.optim.Adam([l1.weight, l2.weight], lr=0.1)
        return ({"x": x, "y": y, "opt": opt} if xy else {"y": y, "x": x, "opt": opt}), l1, l2, opt

    state, l1, l2, opt = build(xy=True)
    (l1.weight.sum() + l2.weight.sum() * 100).backward()
    opt.step()
    stashpoint.save(state, tmp_path / "c")
    fresh, f1, _, fopt = build(xy=True)
    with pytest.warns(UserWarning, match=r"'a.weight' in the first module .* 'b.weight' in another.*list them as then"):
        stashpoint.load(fresh, tmp_path / "c")
    assert torch.equal(fopt.state[f1.weight]["exp_avg"], opt.state[l1.weight]["exp_avg"])  # the order kept: right
