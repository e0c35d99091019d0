"""Tensors and values off the common path: subclasses, sparse and nested templates, inference
tensors, shapes and ints the format cannot hold. Each is saved and loaded back exactly, or
refused with its key named before anything is written."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

import stashpoint
from stashpoint._tools.diff import max_abs_diff
from stashpoint.errors import CheckpointError, StateMismatchError, UnsupportedStateError


def test_a_wrapper_subclass_in_a_parameter_is_refused_by_key_and_a_plain_parameter_subclass_saved(tmp_path):
    """Before: a Parameter around a wrapper subclass (torchao-style weights) passed the check
    and was saved with the bytes of one inner tensor; loading into one failed with EFAULT."""
    wrapped = torch.nn.Parameter(TwoTensor(torch.arange(4.0), torch.arange(4.0) + 100))
    for state in ({"w": wrapped}, {"w": TwoTensor(torch.zeros(4), torch.ones(4))}):
        with pytest.raises(UnsupportedStateError, match="tensor subclass TwoTensor at key 'w'"):
            stashpoint.save(state, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()

    class Tagged(torch.nn.Parameter):  # a Parameter subclass of plain memory (as FSDP1's FlatParameter)
        pass

    stashpoint.save({"w": Tagged(torch.arange(4.0))}, tmp_path / "plain")
    assert torch.equal(stashpoint.read(tmp_path / "plain")["w"], torch.arange(4.0))
    for atomic in (False, True):
        target = {"w": torch.nn.Parameter(TwoTensor(torch.zeros(4), torch.zeros(4)))}
        with pytest.raises(StateMismatchError, match="'w': the state's tensor is a TwoTensor, a tensor subclass"):
            stashpoint.load(target, tmp_path / "plain", atomic=atomic)


@pytest.mark.parametrize(
    ("template", "says"),
    [
        (torch.eye(3).to_sparse_csr(), "of layout torch.sparse_csr"),
        (torch.eye(3).to_sparse(), "of layout torch.sparse_coo"),
        (torch.nested.nested_tensor([torch.zeros(3), torch.zeros(3)]), "a nested tensor"),
    ],
    ids=["csr", "coo", "nested"],
)
def test_a_sparse_or_nested_template_is_a_mismatch_naming_its_layout(tmp_path, template, says):
    """Before: torch's RuntimeError (no strides, no sizes) or a wrong reason (an expanded view)."""
    stashpoint.save({"w": torch.eye(3)}, tmp_path / "ck")
    with pytest.raises(StateMismatchError, match=f"'w': the state's tensor is {says}"):
        stashpoint.load({"w": template}, tmp_path / "ck")


@pytest.mark.parametrize("atomic", [False, True])
def test_tensors_made_in_inference_mode_load_in_place(tmp_path, atomic):
    """Before: atomic=True raised torch's RuntimeError part-way, half of the state loaded."""
    stashpoint.save({"a": torch.ones(4), "b": torch.full((4,), 2.0), "step": 7}, tmp_path / "ck")
    with torch.inference_mode():
        b = torch.zeros(4)
    state = {"a": torch.zeros(4), "b": b, "step": 0}
    stashpoint.load(state, tmp_path / "ck", atomic=atomic)
    assert torch.equal(state["a"], torch.ones(4)) and torch.equal(b, torch.full((4,), 2.0)) and state["step"] == 7


def test_a_load_counts_as_an_in_place_change_for_autograd(tmp_path):
    """A graph still holding a tensor a load wrote must fail at backward(), as after copy_().
    Before: bytes read straight into the tensor left its version as it was, and backward()
    computed gradients from the new values in silence."""
    stashpoint.save({"w": torch.full((3,), 5.0)}, tmp_path / "ck")
    for atomic in (False, True):
        w, x = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
        y = (w * x).sum()
        stashpoint.load({"w": w}, tmp_path / "ck", atomic=atomic)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()


@pytest.mark.parametrize(
    ("tensor", "says"),
    [
        (torch.zeros([1] * 65), "has 65 dimensions, more than the format's 64"),
        (torch.empty(0, 2**62), r"of shape \[0, 4611686018427387904\] holds more bytes than the format's 2\*\*62"),
        (torch.empty(0, 2**61), r"of shape \[0, 2305843009213693952\] holds more bytes"),  # 4-byte floats
    ],
    ids=["dims", "dim", "bytes"],
)
def test_a_tensor_a_load_would_call_damaged_is_refused_at_the_save(tmp_path, tensor, says):
    """Before: saved, then read as a damaged checkpoint (a manager's restore set it aside)."""
    with stashpoint.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"t": torch.zeros(2)}).wait()
        with pytest.raises(UnsupportedStateError, match=f"the tensor at key 't' {says}"):
            mgr.save(2, {"t": tensor})
        mgr.wait()
        assert mgr.steps() == [1]


def test_an_int_longer_than_python_reads_back_is_refused_at_the_call_by_key(tmp_path):
    """Before: a dict key raised a bare ValueError, and a value failed in the background."""
    big = 10**5000
    with pytest.raises(UnsupportedStateError, match="dict key under 'ids' is an int of more than 4300 digits"):
        stashpoint.save({"ids": {big: torch.ones(1)}}, tmp_path / "a")
    with pytest.raises(UnsupportedStateError, match="value at key 'cfg/seed' is an int of more than 4300 digits"):
        stashpoint.async_save({"cfg": {"seed": -big}}, tmp_path / "b")
    stashpoint.save({"v": 10**4299, "k": {-(10**4299): 1}}, tmp_path / "c")  # the longest that reads back
    assert stashpoint.read(tmp_path / "c") == {"v": 10**4299, "k": {-(10**4299): 1}}


def test_diff_of_64_bit_ints_is_exact():
    """Before: both sides went through float64, and 2**62 + 1 against 2**62 differed by 0."""
    assert max_abs_diff(torch.tensor([2**62 + 1, 3]), torch.tensor([2**62, 3])) == 1
    assert (
        max_abs_diff(torch.tensor([2**63 - 1], dtype=torch.uint64), torch.tensor([2**63 + 1], dtype=torch.uint64)) == 2
    )
    assert max_abs_diff(torch.tensor([1, 2], dtype=torch.int32), torch.tensor([1, 5])) == 3
    assert max_abs_diff(torch.tensor([7]), torch.tensor([7])) is False


def test_refusals_off_the_common_path_name_the_key(tmp_path):
    with pytest.raises(UnsupportedStateError, match="at key 'cfg/cls': Linear is a class"):
        stashpoint.save({"cfg": {"cls": torch.nn.Linear}}, tmp_path / "a")
    with pytest.raises(TypeError, match=r"metadata\['epoch'\] is a int"):
        stashpoint.save({"w": torch.ones(1)}, tmp_path / "b", metadata={"run": "x", "epoch": 3})
    with pytest.raises(TypeError, match="metadata must be a dict of str to str, not int"):
        stashpoint.save({"w": torch.ones(1)}, tmp_path / "b", metadata=5)  # type: ignore[arg-type]
    stashpoint.save({"%": torch.ones(1)}, tmp_path / "c")
    escaped = r"has no key '%'; the keys under 'the root' are '%25' \(a key holding '/' or '%' is selected escaped"
    with pytest.raises(CheckpointError, match=escaped):
        stashpoint.read(tmp_path / "c", select="%")
    assert torch.equal(stashpoint.read(tmp_path / "c", select="%25"), torch.ones(1))
    stashpoint.save(5, tmp_path / "d")
    with pytest.raises(StateMismatchError, match="a plain value at its root, is not changed in place"):
        stashpoint.load(0, tmp_path / "d")


def test_a_parameter_of_a_subclass_of_plain_memory_saves_and_loads(tmp_path):
    """A subclass with no __torch_dispatch__ of its own (a tag, a __torch_function__ override)
    holds its data at data_ptr(): in a Parameter it saves as before, and loads into one."""

    class Tagged(torch.Tensor):
        pass

    stashpoint.save({"w": torch.nn.Parameter(torch.arange(3.0).as_subclass(Tagged))}, tmp_path / "ck")
    back = {"w": torch.nn.Parameter(torch.zeros(3).as_subclass(Tagged))}
    stashpoint.load(back, tmp_path / "ck")
    assert type(back["w"]) is Tagged and torch.equal(back["w"], torch.arange(3.0))


def test_import_strips_prefixes_inside_tuples_and_takes_one_prefix_as_a_string(tmp_path):
    from stashpoint._core.nodes import wrapper_hint
    from stashpoint._tools.convert import import_checkpoint, stripped

    t = torch.ones(1)
    assert stripped({"module.m": ({"module.w": t},)}, ("module.",)) == {"m": ({"w": t},)}
    torch.save({"module.embed": t, "module.lm_head": t}, tmp_path / "f.pt")
    import_checkpoint(tmp_path / "f.pt", tmp_path / "ck", strip_prefix="module.")
    assert set(stashpoint.read(tmp_path / "ck")) == {"embed", "lm_head"}, "a string is one prefix, not its letters"
    # the hint names the option only where the checkpoint's keys lead with the wrapper's parts
    hint = wrapper_hint(["model/0.weight"], ["model/_orig_mod.module.0.weight"]) or ""
    assert "--strip-prefix '_orig_mod.' --strip-prefix 'module.'" in hint
    assert "--strip-prefix" not in (wrapper_hint(["model/module.0.weight"], ["model/0.weight"]) or "")


def test_preemption_signals_may_be_any_iterable(tmp_path):
    import signal

    with stashpoint.CheckpointManager(
        tmp_path / "r", preemption_deadline=5, preemption_signals=iter([signal.SIGUSR1])
    ) as mgr:
        assert mgr._preemption is not None and mgr._preemption._signals == (signal.SIGUSR1,)
        assert signal.getsignal(signal.SIGUSR1) == mgr._preemption._note


def test_views_whose_elements_overlap_are_refused_and_strided_views_that_do_not_load_in_place(tmp_path):
    """Torch's own overlap test answers "too hard" for any view that is not dense. Before, only
    an expand was refused: a sliding window (unfold, as_strided) took the load's bytes one over
    another and came back wrong, in silence."""
    src = torch.arange(12.0).reshape(4, 3)
    stashpoint.save({"t": src}, tmp_path / "ck")
    for window in (torch.zeros(10).as_strided((4, 3), (1, 1)), torch.zeros(20).as_strided((4, 3), (2, 1))):
        with pytest.raises(StateMismatchError, match="'t': the state's tensor is a view whose elements share memory"):
            stashpoint.load({"t": window}, tmp_path / "ck")
    stashpoint.save({"t": torch.arange(16.0).reshape(4, 4)}, tmp_path / "sq")
    with pytest.raises(StateMismatchError, match="elements share memory"):
        stashpoint.load({"t": torch.zeros(10).unfold(0, 4, 2)}, tmp_path / "sq")
    # apart, though torch cannot tell: a step slice, windows side by side, strides interleaved
    for live in (
        torch.zeros(8, 6)[::2, ::2],
        torch.zeros(16).unfold(0, 4, 4),
        torch.zeros(12).as_strided((4, 3), (3, 1)).t().t(),
        torch.zeros(30).as_strided((4, 3), (7, 2)),
    ):
        assert torch._debug_has_internal_overlap(live) in (0, 2)
        stashpoint.load({"t": live}, tmp_path / ("sq" if live.shape == (4, 4) else "ck"))
        assert torch.equal(live, src if live.shape == (4, 3) else torch.arange(16.0).reshape(4, 4))
    interleaved = torch.zeros(8).as_strided((3, 2), (2, 3))  # offsets 0 2 4 / 3 5 7: apart
    stashpoint.save({"t": torch.arange(6.0).reshape(3, 2)}, tmp_path / "il")
    stashpoint.load({"t": interleaved}, tmp_path / "il")
    assert torch.equal(interleaved, torch.arange(6.0).reshape(3, 2))


def test_an_objects_own_tensors_a_load_cannot_write_are_handed_to_it_fresh(tmp_path):
    """An object with state_dict()/load_state_dict() whose live state_dict() holds a meta
    tensor or a wrapper subclass: before, the load read into it (nothing landed, or EFAULT
    blamed on the storage); now its load_state_dict gets a fresh tensor of the saved values."""

    class Holder:
        def __init__(self, t: torch.Tensor) -> None:
            self.t, self.got = t, None

        def state_dict(self) -> dict[str, torch.Tensor]:
            return {"t": self.t}

        def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
            self.got = sd["t"]

    src = torch.arange(9.0).reshape(3, 3)
    stashpoint.save({"o": Holder(src)}, tmp_path / "ck")
    for live in (torch.zeros(3, 3, device="meta"), TwoTensor(torch.zeros(3, 3), torch.zeros(3, 3))):
        holder = Holder(live)
        stashpoint.load({"o": holder}, tmp_path / "ck")
        assert holder.got is not live and holder.got.device.type == "cpu" and torch.equal(holder.got, src)


def test_a_torch_size_in_the_state_comes_back_a_torch_size(tmp_path):
    """Saved as a tuple; before, it came back a tuple even where the live state held a
    torch.Size (code calling .numel() on it then failed)."""
    saved = {"shape": torch.Size([2, 3]), "meta": {"shape": torch.Size([4]), "all": [torch.Size([5]), (1, 2)]}}
    stashpoint.save({**saved, "w": torch.ones(2)}, tmp_path / "ck")
    live = {"shape": torch.Size([0]), "meta": {"shape": torch.Size([1]), "all": [torch.Size([0]), (0, 0)]}}
    state = {**live, "w": torch.zeros(2)}
    stashpoint.load(state, tmp_path / "ck")
    assert state["shape"] == torch.Size([2, 3]) and type(state["shape"]) is torch.Size
    assert type(state["meta"]["shape"]) is torch.Size and type(state["meta"]["all"][0]) is torch.Size
    assert state["meta"] == saved["meta"] and type(state["meta"]["all"][1]) is tuple
    point = collections.namedtuple("point", "x y", defaults=(0,))
    stashpoint.save({"p": (1, 2), "q": (7,), "w": torch.ones(2)}, tmp_path / "nt")
    state = {"p": point(0, 0), "q": point(0), "w": torch.zeros(2)}
    stashpoint.load(state, tmp_path / "nt")  # a named tuple would take a list whole as its first field
    assert state["p"] == (1, 2) and state["q"] == (7,) and type(state["p"]) is tuple


@pytest.mark.skipif(not hasattr(torch, "float8_e8m0fnu"), reason="a torch before float8_e8m0fnu (2.7)")
def test_a_dtype_this_torch_lacks_is_an_old_torch_not_damage(tmp_path, monkeypatch):
    """A checkpoint saved under a newer torch holds a dtype an older one lacks (emulated: the
    name taken out of this torch's table). Before, that was "unknown dtype": corruption, and
    the manager's restore moved the sound steps aside as damaged."""
    from stashpoint._state import dtypes

    param = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    opt.state[param]["momentum_buffer"] = torch.ones(4, dtype=torch.float8_e8m0fnu)
    with stashpoint.CheckpointManager(tmp_path / "run", keep_last=None) as mgr:
        mgr.save(1, {"opt": opt}).wait()
    stashpoint.save({"x": torch.ones(2, dtype=torch.float8_e8m0fnu)}, tmp_path / "ck")
    monkeypatch.delitem(dtypes._BY_NAME, "float8_e8m0fnu")
    with pytest.raises(CheckpointError, match=r"dtype float8_e8m0fnu, which torch .* does not have") as e:
        stashpoint.read(tmp_path / "ck")
    assert not isinstance(e.value, stashpoint.CorruptCheckpointError)
    fresh = torch.optim.SGD([torch.nn.Parameter(torch.ones(4))], lr=0.1, momentum=0.9)
    with (
        stashpoint.CheckpointManager(tmp_path / "run", keep_last=None) as mgr,
        pytest.raises(CheckpointError, match="saved with a newer torch"),
    ):
        mgr.restore({"opt": fresh})
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("step-")) == ["step-00000001"]
    monkeypatch.undo()
    with stashpoint.CheckpointManager(tmp_path / "run", keep_last=None) as mgr:
        assert mgr.restore({"opt": fresh}) == 1  # the same step with the newer torch


def test_a_counter_in_the_state_or_a_multisteplrs_milestones_comes_back_a_counter(tmp_path):
    """Saved as a dict; before, it came back a dict: a MultiStepLR's closed form (step(epoch))
    calls milestones.elements() and failed after a resume."""

    def scheduler() -> torch.optim.lr_scheduler.MultiStepLR:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0)
        return torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4, 4], gamma=0.5)

    sched = scheduler()
    for _ in range(3):
        sched.optimizer.step()
        sched.step()
    stashpoint.save({"sched": sched, "counts": collections.Counter("abca")}, tmp_path / "ck")
    state = {"sched": scheduler(), "counts": collections.Counter()}
    stashpoint.load(state, tmp_path / "ck")
    assert type(state["counts"]) is collections.Counter and state["counts"] == collections.Counter("abca")
    assert type(state["sched"].milestones) is collections.Counter and state["sched"].milestones == sched.milestones
    assert state["sched"]._get_closed_form_lr() == sched._get_closed_form_lr() == [0.5]

    def sequential() -> torch.optim.lr_scheduler.SequentialLR:  # its schedulers' states in a list
        opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0)
        first = torch.optim.lr_scheduler.ConstantLR(opt, factor=0.5, total_iters=2)
        second = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4], gamma=0.5)
        return torch.optim.lr_scheduler.SequentialLR(opt, [first, second], milestones=[3])

    seq = sequential()
    for _ in range(2):
        seq.optimizer.step()
        seq.step()
    stashpoint.save({"sched": seq}, tmp_path / "seq")
    state = {"sched": sequential()}
    stashpoint.load(state, tmp_path / "seq")
    for _ in range(3):  # past the switch, where SequentialLR takes the closed form
        seq.optimizer.step()
        seq.step()
        state["sched"].optimizer.step()
        state["sched"].step()
    assert state["sched"].get_last_lr() == seq.get_last_lr()


class _Shapes:
    """A stateful object whose own state holds shapes."""

    def __init__(self, shape: list[int]) -> None:
        self.sd = {"shape": torch.Size(shape), "all": [torch.Size([1]), (1, 2)], "t": torch.zeros(2)}

    def state_dict(self):  # type: ignore[no-untyped-def]
        return dict(self.sd)

    def load_state_dict(self, sd):  # type: ignore[no-untyped-def]
        self.sd = sd


def test_a_torch_size_in_an_objects_state_comes_back_a_torch_size(tmp_path):
    """Before, only plain values kept it: an object's state_dict got a tuple back."""
    stashpoint.save({"o": _Shapes([2, 3])}, tmp_path / "ck")
    obj = _Shapes([0, 0])
    stashpoint.load({"o": obj}, tmp_path / "ck")
    assert obj.sd["shape"] == torch.Size([2, 3]) and type(obj.sd["shape"]) is torch.Size
    assert type(obj.sd["all"][0]) is torch.Size and type(obj.sd["all"][1]) is tuple
