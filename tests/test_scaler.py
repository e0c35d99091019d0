"""GradScaler: saved from its own tensors (no ``.item()``, no host sync), loaded back as torch's
``state_dict()`` numbers, from checkpoints of either form."""

from __future__ import annotations

import pytest
import torch

import stashpoint
from conftest import small_model, whole
from stashpoint._state.scaler import scaler_load_state, scaler_state
from stashpoint._state.tree import flatten

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _amp_steps(model, optim, scaler, n: int, *, seed: int = 1, inf_at: int | None = None) -> None:
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    for i in range(n):
        x = torch.randn(4, 8, generator=g).to(device)
        loss = model(x).pow(2).mean()
        if i == inf_at:
            loss = loss * float("inf")  # a skipped step: the scale backs off
        scaler.scale(loss).backward()
        scaler.step(optim)
        scaler.update()
        optim.zero_grad()


def _trained(device: str = "cpu"):
    """A model, its optimizer and a scaler that grew once, backed off once and counts 2 steps."""
    model = small_model().to(device)
    optim = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=3)
    _amp_steps(model, optim, scaler, 6, inf_at=3)  # grows after step 2, backs off at 3, two steps since
    assert (scaler.get_scale(), scaler._get_growth_tracker()) == (2.0**10, 2)
    return model, optim, scaler


def _assert_same_scaler(loaded: torch.amp.GradScaler, saved: torch.amp.GradScaler) -> None:
    assert loaded.state_dict() == saved.state_dict()
    assert type(loaded.get_scale()) is float and loaded.get_scale() == saved.get_scale()
    assert type(loaded._get_growth_tracker()) is int
    assert loaded._get_growth_tracker() == saved._get_growth_tracker()
    for k, v in loaded.state_dict().items():
        assert type(v) is type(saved.state_dict()[k]), k


def test_scaler_state_is_state_dict_with_the_live_tensors():
    _, _, scaler = _trained()
    sd = scaler_state(scaler)
    assert sd is not None
    assert list(sd) == list(scaler.state_dict())
    assert sd["scale"] is scaler._scale and sd["_growth_tracker"] is scaler._growth_tracker
    assert scaler_load_state(sd) == scaler.state_dict()
    assert all(type(v) is type(scaler.state_dict()[k]) for k, v in scaler_load_state(sd).items())


def test_scaler_state_leaves_other_scalers_to_their_state_dict():
    assert scaler_state(torch.amp.GradScaler("cpu", enabled=False)) is None
    assert scaler_state(torch.amp.GradScaler("cpu")) is None  # not used yet: numbers, no tensor to wait for
    assert scaler_state(object()) is None

    class Plain(torch.amp.GradScaler):
        pass

    class Own(torch.amp.GradScaler):
        def state_dict(self):
            return {**super().state_dict(), "extra": 1}

    for cls, native in ((Plain, True), (Own, False)):
        s = cls("cpu")
        s._lazy_init_scale_growth_tracker(torch.device("cpu"))
        assert (scaler_state(s) is not None) == native, cls


@pytest.mark.parametrize("how", ["save", "async_save", "overlap"])
@pytest.mark.parametrize("target", ["fresh", "used"])
def test_scaler_round_trip_and_training_continues_identically(tmp_path, how, target):
    model, optim, scaler = _trained()
    state = {"model": model, "optim": optim, "scaler": scaler}
    if how == "save":
        stashpoint.save(state, tmp_path / "ck")
    else:
        stashpoint.async_save(state, tmp_path / "ck", overlap=how == "overlap").wait()
    stored = whole(tmp_path / "ck").tensors
    assert {"scaler/scale", "scaler/_growth_tracker"} <= set(stored), "saved as tensors"

    model2 = small_model(seed=7)
    optim2 = torch.optim.SGD(model2.parameters(), lr=1e-3)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=9)
    if target == "used":  # its own scale and tracker tensors exist: filled in place
        _amp_steps(model2, optim2, scaler2, 2, seed=4)
        assert scaler2._scale is not None
    stashpoint.load({"model": model2, "optim": optim2, "scaler": scaler2}, tmp_path / "ck")
    _assert_same_scaler(scaler2, scaler)
    assert type(scaler2._init_scale) is float and type(scaler2._init_growth_tracker) is int

    for s, m, o in ((scaler, model, optim), (scaler2, model2, optim2)):
        _amp_steps(m, o, s, 5, seed=9, inf_at=2)
    _assert_same_scaler(scaler2, scaler)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_a_save_never_calls_item(tmp_path, monkeypatch):
    model, optim, scaler = _trained()

    def no_item(self):
        raise AssertionError("Tensor.item() during a save: it waits for the GPU")

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "item", no_item)
        stashpoint.save({"model": model, "optim": optim, "scaler": scaler}, tmp_path / "ck")
        stashpoint.async_save({"scaler": scaler}, tmp_path / "ck2", overlap=True).wait()
    fresh = torch.amp.GradScaler("cpu")
    stashpoint.load({"scaler": fresh}, tmp_path / "ck2")
    _assert_same_scaler(fresh, scaler)


class _FloatScaler:
    """Saves a scaler as stashpoint did before its tensors were saved: ``state_dict()``'s numbers."""

    def __init__(self, inner: torch.amp.GradScaler) -> None:
        self.inner = inner

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, sd) -> None:
        self.inner.load_state_dict(sd)


@pytest.mark.parametrize("target", ["fresh", "used"])
def test_a_checkpoint_with_the_scale_as_a_number_still_loads(tmp_path, target):
    _, _, scaler = _trained()
    old = _FloatScaler(scaler)
    assert flatten({"scaler": old})[1] == [], "the old layout: numbers only"
    stashpoint.save({"scaler": old}, tmp_path / "ck")
    assert not whole(tmp_path / "ck").tensors

    fresh = torch.amp.GradScaler("cpu", init_scale=5.0, growth_interval=11)
    if target == "used":
        fresh._lazy_init_scale_growth_tracker(torch.device("cpu"))
    stashpoint.load({"scaler": fresh}, tmp_path / "ck")
    _assert_same_scaler(fresh, scaler)


def test_a_new_checkpoint_has_the_node_shape_of_an_old_one():
    _, _, scaler = _trained()
    new_tree, new_tensors = flatten({"scaler": scaler})
    old_tree, _ = flatten({"scaler": _FloatScaler(scaler)})
    assert [k for k, _ in new_tensors] == ["scaler/scale", "scaler/_growth_tracker"]
    new_node, old_node = new_tree["dict"][0][1], old_tree["dict"][0][1]
    assert new_node["stateful"] == old_node["stateful"] == "object"
    assert [k for k, _ in new_node["state"]["dict"]] == [k for k, _ in old_node["state"]["dict"]]
    kinds = {k: next(iter(v)) for k, v in new_node["state"]["dict"]}
    assert kinds == {
        "scale": "tensor",
        "growth_factor": "value",
        "backoff_factor": "value",
        "growth_interval": "value",
        "_growth_tracker": "tensor",
    }


@pytest.mark.parametrize("used", [False, True])
def test_disabled_and_unused_scalers_round_trip(tmp_path, used):
    off = torch.amp.GradScaler("cpu", enabled=False)
    unused = torch.amp.GradScaler("cpu", init_scale=2.0**7, growth_interval=5)
    stashpoint.save({"off": off, "unused": unused}, tmp_path / "ck")
    assert not whole(tmp_path / "ck").tensors

    off2 = torch.amp.GradScaler("cpu", enabled=False)
    unused2 = torch.amp.GradScaler("cpu", init_scale=3.0)
    if used:
        unused2._lazy_init_scale_growth_tracker(torch.device("cpu"))
    stashpoint.load({"off": off2, "unused": unused2}, tmp_path / "ck")
    assert off2.state_dict() == {} and off2.get_scale() == 1.0
    _assert_same_scaler(unused2, unused)


@cuda
def test_saving_a_cuda_scaler_does_not_synchronize(tmp_path):
    model, optim, scaler = _trained("cuda")
    state = {"scaler": scaler}
    stashpoint.async_save(state, tmp_path / "warm", overlap=True).wait()  # staging memory, streams
    torch.cuda.synchronize()

    # the value at the time of the call is one a kernel queued before it has not written yet
    busy = torch.randn(2048, 2048, device="cuda")
    for _ in range(20):
        busy = busy @ busy / 2048
    scaler.update(new_scale=torch.full((), 2.0**5, device="cuda"))
    torch.cuda.set_sync_debug_mode("error")  # .item(), blocking copies, synchronize() raise
    try:
        assert scaler_state(scaler) is not None
        handle = stashpoint.async_save(state, tmp_path / "ck", overlap=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    scaler.update(new_scale=2.0**3)  # after the call: not in the checkpoint
    handle.wait()

    fresh = torch.amp.GradScaler("cuda")
    stashpoint.load({"scaler": fresh}, tmp_path / "ck")
    assert fresh.get_scale() == 2.0**5 and fresh._get_growth_tracker() == 2
    assert scaler.get_scale() == 2.0**3
    assert fresh.state_dict() == {**scaler.state_dict(), "scale": 2.0**5}
    _amp_steps(model, optim, fresh, 2, seed=3)  # a loaded scaler scales CUDA losses
