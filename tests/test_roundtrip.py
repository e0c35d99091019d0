"""Round trips: whatever a state may hold comes back bit for bit."""

from __future__ import annotations

import collections
import math
import os
import threading
import uuid
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stashpoint
from conftest import ROOT, small_model, train_steps, whole
from stashpoint._save.engine import get_engine
from test_format import ALL_DTYPES, _random_tensor


def _bits(t: torch.Tensor) -> list[int]:
    t = t.detach().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).tolist() if t.numel() else []


def assert_same(a, b, where="<root>"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert _bits(a) == _bits(b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b and type(a) is type(b), where


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(ALL_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
    if not shape:
        return _random_tensor(dtype, (1,)).reshape(())
    t = _random_tensor(dtype, shape)
    if len(shape) >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)  # non-contiguous
    return t


plain = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=10)
    | st.binary(max_size=10)
)
states = st.recursive(
    tensors() | plain,
    lambda kids: (
        st.lists(kids, max_size=4)
        | st.lists(kids, max_size=3).map(tuple)
        | st.dictionaries(st.text(min_size=1, max_size=6) | st.integers(0, 9), kids, max_size=4)
    ),
    max_leaves=10,
)


def _zeros_like(obj):
    if isinstance(obj, torch.Tensor):
        return torch.empty(obj.shape, dtype=obj.dtype)
    if isinstance(obj, dict):
        return {k: _zeros_like(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_zeros_like(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_zeros_like(v) for v in obj)
    return None  # plain values come back from the checkpoint


@given(st.dictionaries(st.text(min_size=1, max_size=6), states, max_size=5))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_hypothesis_round_trip(tmp_path, state):
    path = tmp_path / f"ck-{uuid.uuid4().hex}"
    stashpoint.save(state, path, overwrite=True)
    target = _zeros_like(state)
    stashpoint.load(target, path)
    assert_same(state, target)


def test_all_dtypes_round_trip(tmp_path):
    state = {str(d): _random_tensor(d, (4, 6)) for d in ALL_DTYPES}
    state["scalars"] = {str(d): _random_tensor(d, (1,)).reshape(()) for d in ALL_DTYPES}
    stashpoint.save(state, tmp_path / "ck")
    target = _zeros_like(state)
    stashpoint.load(target, tmp_path / "ck")
    assert_same(state, target)


def test_views_and_non_contiguous_tensors(tmp_path):
    base = torch.arange(60.0).reshape(6, 10)
    state = {"t": base.t(), "slice": base[2:4, 3:7], "step": base[::2, ::3], "expanded": torch.ones(3, 1).expand(3, 5)}
    stashpoint.save(state, tmp_path / "ck")
    target = {k: torch.empty(v.shape) for k, v in state.items()}
    stashpoint.load(target, tmp_path / "ck")
    assert_same({k: v.contiguous() for k, v in state.items()}, target)
    # loading into non-contiguous destinations writes through the views
    dest = torch.zeros(6, 10)
    stashpoint.load(
        {"t": dest.t(), "slice": torch.empty(2, 4), "step": torch.empty(3, 4), "expanded": torch.empty(3, 5)},
        tmp_path / "ck",
    )
    assert torch.equal(dest.t(), base.t())


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def test_tied_weights_are_saved_once_and_come_back_tied(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    stats = stashpoint.save({"model": model}, tmp_path / "ck")
    manifest = whole(tmp_path / "ck")
    aliased = [e for e in manifest.tensors.values() if e.alias_of is not None]
    assert [e.key for e in aliased] == ["model/head.weight"]
    (shard,) = (tmp_path / "ck").glob("shard-*")
    assert shard.stat().st_size == 4096 + 10 * 4 * 4  # the weight is stored once
    assert stats.num_tensors == 2 and stats.num_files == 1
    fresh = Tied()
    stashpoint.load({"model": fresh}, tmp_path / "ck")
    assert fresh.head.weight is fresh.emb.weight
    assert torch.equal(fresh.emb.weight, model.emb.weight)
    raw: dict = {"model": {}}
    stashpoint.load(raw, tmp_path / "ck")
    assert raw["model"]["emb.weight"] is raw["model"]["head.weight"]


def test_training_objects_round_trip(tmp_path):
    model = small_model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=10)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    train_steps(model, optim, 3)
    sched.step()
    state = {"model": model, "optim": optim, "sched": sched, "scaler": scaler, "step": 3}
    stashpoint.save(state, tmp_path / "ck")

    model2 = small_model(seed=5)
    optim2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.CosineAnnealingLR(optim2, T_max=10)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=2.0)
    state2 = {"model": model2, "optim": optim2, "sched": sched2, "scaler": scaler2, "step": 0}
    stashpoint.load(state2, tmp_path / "ck")
    assert_same(model.state_dict(), model2.state_dict())
    assert_same(optim.state_dict(), optim2.state_dict())
    assert sched.state_dict() == sched2.state_dict()
    assert scaler.state_dict() == scaler2.state_dict()
    assert state2["step"] == 3
    # training continues identically
    train_steps(model, optim, 2, seed=9)
    train_steps(model2, optim2, 2, seed=9)
    assert_same(model.state_dict(), model2.state_dict())


def test_a_partial_load_takes_what_the_state_holds_and_reads_nothing_else(tmp_path, monkeypatch):
    from stashpoint._load import loader

    model = small_model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, optim, 2)
    stashpoint.save({"model": model, "optim": optim, "extra": torch.ones(3), "step": 2}, tmp_path / "ck")
    fresh = small_model(seed=3)
    with pytest.raises(stashpoint.StateMismatchError, match="unexpected key 'optim'"):
        stashpoint.load({"model": fresh}, tmp_path / "ck")
    plans = []
    real_plan = loader._plan

    def recording_plan(*args, **kwargs):
        out = real_plan(*args, **kwargs)
        plans.append(out[1])
        return out

    monkeypatch.setattr(loader, "_plan", recording_plan)
    state = {"model": fresh}
    stashpoint.load(state, tmp_path / "ck", partial=True)
    assert set(state) == {"model"}  # no key of the checkpoint's is added
    assert_same(model.state_dict(), fresh.state_dict())
    assert {r.key.split("/")[0] for r in plans[0].reads} == {"model"}  # the optimizer's bytes are not read
    with pytest.raises(stashpoint.StateMismatchError, match="missing key 'other'"):
        stashpoint.load({"model": fresh, "other": torch.zeros(1)}, tmp_path / "ck", partial=True)


def test_optimizer_state_survives_a_change_in_parameter_order(tmp_path):
    model = small_model()
    params = dict(model.named_parameters())
    optim = torch.optim.Adam([params["2.bias"], params["0.weight"], params["2.weight"], params["0.bias"]], lr=0.1)
    train_steps(model, optim, 2)
    stashpoint.save({"model": model, "optim": optim}, tmp_path / "ck")
    manifest = whole(tmp_path / "ck")
    assert "optim/state/0.weight/exp_avg" in manifest.tensors  # keyed by name, not id

    model2 = small_model(seed=3)
    optim2 = torch.optim.Adam(model2.parameters(), lr=0.5)  # natural order this time
    stashpoint.load({"model": model2, "optim": optim2}, tmp_path / "ck")
    by_name = dict(model2.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(optim.state[p]["exp_avg"], optim2.state[by_name[name]]["exp_avg"]), name
    assert optim2.param_groups[0]["lr"] == 0.1


def test_optimizer_without_model_falls_back_to_integer_ids(tmp_path):
    model = small_model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_steps(model, optim, 2)
    stashpoint.save({"optim": optim}, tmp_path / "ck")
    model2 = small_model()
    optim2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    stashpoint.load({"optim": optim2}, tmp_path / "ck")
    assert_same(optim.state_dict(), optim2.state_dict())


def test_plain_values_come_back_into_placeholders(tmp_path):
    state = {"meta": {"epoch": 3, "name": "run", "lrs": [0.1, 0.01], "t": (1, None)}, "step": 7, "w": torch.ones(2)}
    stashpoint.save(state, tmp_path / "ck")
    target = {"meta": {}, "w": torch.zeros(2)}
    stashpoint.load(target, tmp_path / "ck")
    assert target == {"meta": state["meta"], "step": 7, "w": target["w"]}
    assert torch.equal(target["w"], torch.ones(2))


def test_mappings_of_the_state_keep_their_type_and_default(tmp_path):
    """Before: a defaultdict and a Counter came back as plain dicts, and the training's next
    ``counts[new] += 1`` raised KeyError."""
    counts, tally = collections.defaultdict(int, wiki=3), collections.Counter(a=2)
    order = collections.OrderedDict([("b", 1), ("a", 2)])
    stashpoint.save(
        {"counts": counts, "tally": tally, "order": order, "mixed": collections.defaultdict(list, w=[torch.ones(2)])},
        tmp_path / "ck",
    )
    state = {
        "counts": collections.defaultdict(int, old=1),
        "tally": collections.Counter(),
        "order": collections.OrderedDict(),
        "mixed": collections.defaultdict(list, w=[torch.zeros(2)]),
    }
    live = dict(state)
    stashpoint.load(state, tmp_path / "ck")
    assert all(state[k] is live[k] for k in state)  # filled in place
    assert state["counts"] == {"wiki": 3} and state["tally"] == {"a": 2} and list(state["order"]) == ["b", "a"]
    state["counts"]["books"] += 1
    state["tally"].update("b")
    assert state["counts"]["books"] == 1 and state["tally"]["b"] == 1
    assert torch.equal(state["mixed"]["w"][0], torch.ones(2)) and state["mixed"]["new"] == []


def test_mappings_nested_in_plain_values_or_an_objects_state_keep_their_type_and_default(tmp_path):
    """Before: only a top-level defaultdict kept its type; one inside a dict, or in an object's
    state_dict, came back a plain dict (and an OrderedDict a dict)."""

    class Tally:
        def __init__(self) -> None:
            self.seen: collections.defaultdict[str, list[int]] = collections.defaultdict(list)

        def state_dict(self) -> dict:
            return {"seen": self.seen}

        def load_state_dict(self, sd: dict) -> None:
            self.seen = sd["seen"]

    saved = Tally()
    saved.seen["a"].append(1)
    meta = {"counts": collections.defaultdict(int, a=1), "order": collections.OrderedDict(b=2, a=1)}
    stashpoint.save({"meta": meta, "tally": saved}, tmp_path / "ck")
    state = {"meta": {"counts": collections.defaultdict(int), "order": collections.OrderedDict()}, "tally": Tally()}
    stashpoint.load(state, tmp_path / "ck")
    counts, order, seen = state["meta"]["counts"], state["meta"]["order"], state["tally"].seen
    assert type(counts) is collections.defaultdict and counts.default_factory is int and counts == {"a": 1}
    assert type(order) is collections.OrderedDict and list(order) == ["b", "a"]
    assert type(seen) is collections.defaultdict and seen == {"a": [1]}
    counts["b"] += 1
    seen["b"].append(2)
    assert counts["b"] == 1 and seen["b"] == [2]

    # a defaultdict(Counter), top-level (filled in place) and nested: its Counters come back too
    words = collections.defaultdict(collections.Counter, en=collections.Counter(the=2))
    stashpoint.save({"words": words, "meta": {"words": words}}, tmp_path / "words")
    state = {"words": collections.defaultdict(collections.Counter), "meta": {"words": collections.defaultdict(int)}}
    top = state["words"]
    stashpoint.load(state, tmp_path / "words")
    assert state["words"] is top and type(top["en"]) is collections.Counter and top["en"] == {"the": 2}
    assert type(state["meta"]["words"]["en"]) is dict  # a default that is not a Counter: as saved
    top["en"].update(["a"])
    assert top["en"]["a"] == 1


def test_a_lazy_module_not_run_yet_loads_as_torch_loads_it_and_refuses_to_save(tmp_path):
    """Before: torch's ValueError ("Attempted to use an uninitialized parameter"), naming no key,
    from the load and from the save."""

    def lazy() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.ReLU(), torch.nn.LazyLinear(2))

    torch.manual_seed(0)
    model = lazy()
    x = torch.randn(3, 5)
    model(x)
    stashpoint.save({"model": model}, tmp_path / "ck")
    fresh = lazy()
    stashpoint.load({"model": fresh}, tmp_path / "ck")
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    assert torch.equal(fresh(x), model(x)) and type(fresh[0]) is torch.nn.Linear
    with pytest.raises(stashpoint.UnsupportedStateError, match=r"'model/0.weight' belongs to a lazy module.*forward"):
        stashpoint.save({"model": lazy()}, tmp_path / "lazy")


def test_empty_containers_in_the_state_take_the_saved_tensors_grown_by_training(tmp_path):
    """A list of detached losses or ``{epoch: tensor}`` starts empty in a fresh process. Before,
    a strict load refused them ("the checkpoint holds a sequence of 2 items, the state holds list
    of 0 items"); the same containers of floats loaded."""
    state = {"w": torch.ones(2), "losses": [torch.tensor(1.5), torch.tensor(2.5)], "by_epoch": {3: torch.ones(3)}}
    stashpoint.save(state, tmp_path / "ck")
    fresh = {"w": torch.zeros(2), "losses": [], "by_epoch": {}}
    stashpoint.load(fresh, tmp_path / "ck")
    assert [t.item() for t in fresh["losses"]] == [1.5, 2.5] and torch.equal(fresh["by_epoch"][3], torch.ones(3))
    with pytest.raises(stashpoint.StateMismatchError, match="sequence of 2 items, the state holds list of 1"):
        stashpoint.load({"w": torch.zeros(2), "losses": [torch.zeros(())], "by_epoch": {}}, tmp_path / "ck")


def test_partial_takes_nothing_into_an_empty_container(tmp_path):
    """``partial=True`` loads what the state holds and reads nothing else: an empty dict stays
    empty (the rule that an empty one takes the saved one is for full loads)."""
    stashpoint.save({"w": torch.ones(2), "ema": {"big": torch.ones(8)}}, tmp_path / "ck")
    out = {"w": torch.zeros(2), "ema": {}}
    stashpoint.load(out, tmp_path / "ck", partial=True)
    assert out["ema"] == {} and out["w"][0] == 1.0


def test_numpy_floats_that_are_not_finite_come_back(tmp_path):
    """Before: np.float64('nan') was written as "np.float64(nan)" (its repr under NumPy 2), the
    save committed, and every load refused the manifest as damaged."""
    import numpy as np

    state = {"best": np.float64("nan"), "worst": np.float64("-inf"), "hi": np.float64("inf"), "x": np.float64(0.5)}
    stashpoint.save(state, tmp_path / "ck")
    back = stashpoint.read(tmp_path / "ck")
    assert math.isnan(back["best"]) and back["worst"] == -math.inf and back["hi"] == math.inf and back["x"] == 0.5
    assert stashpoint.verify(tmp_path / "ck").ok
    # a checkpoint written before the fix loads too (its manifest re-sealed as such a save sealed it)
    from stashpoint._core.nodes import decode_plain, nonfinite

    assert nonfinite("np.float64(-inf)") == "-inf" and nonfinite("np.float64(1.5)") is None
    # the NumPy values that are refused say how to keep them
    with pytest.raises(stashpoint.UnsupportedStateError, match=r"'lr'.*x\.item\(\).*torch\.from_numpy"):
        stashpoint.save({"lr": np.float32(0.1)}, tmp_path / "np32")
    assert decode_plain({"float": "np.float32(nan)"}, allow_pickle=False, where="x") != 0.0


def test_plain_values_a_load_would_refuse_are_refused_at_the_save(tmp_path):
    """Before: a 200 MiB bytes value (or a list of 10 million ints) saved, and every load refused
    the checkpoint as damaged; in a manager the retention then deleted the good steps."""
    stashpoint.save({"w": torch.ones(2)}, tmp_path / "ck")
    with pytest.raises(stashpoint.CheckpointError, match=r"index would be .* plain values .* too large.*frombuffer"):
        stashpoint.save({"w": torch.ones(2), "blob": b"\0" * (200 << 20)}, tmp_path / "ck", overwrite=True)
    out = {"w": torch.zeros(2)}
    stashpoint.load(out, tmp_path / "ck")  # the earlier checkpoint is whole
    assert out["w"][0] == 1.0 and stashpoint.verify(tmp_path / "ck").ok


@pytest.mark.skipif(torch.cuda.is_available(), reason="a process without a CUDA device")
def test_a_read_to_cuda_in_a_process_without_it_says_so_before_reading(tmp_path):
    stashpoint.save({"w": torch.ones(2)}, tmp_path / "ck")
    with pytest.raises(ValueError, match="device='cuda', but this process has no CUDA device; read to device='cpu'"):
        stashpoint.read(tmp_path / "ck", device="cuda")


class _MakesDir:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_pickle_is_opt_in_on_both_sides(tmp_path):
    from fractions import Fraction

    with pytest.raises(stashpoint.UnsupportedStateError, match=r"'cfg'.*allow_pickle=True"):
        stashpoint.save({"cfg": Fraction(1, 3)}, tmp_path / "ck")
    stashpoint.save({"cfg": Fraction(1, 3)}, tmp_path / "ck", allow_pickle=True)
    with pytest.raises(stashpoint.CheckpointError, match="pickled value"):
        stashpoint.load({}, tmp_path / "ck")
    stashpoint.save({"run": {"ok": [1, 2], "cfgs": [0, Fraction(1, 3)]}}, tmp_path / "deep", allow_pickle=True)
    for select, key in ((None, "run/cfgs/1"), ("run/cfgs", "run/cfgs/1")):  # read names the key as load does
        with pytest.raises(stashpoint.CheckpointError, match=f"pickled value under '{key}'.*allow_pickle=True"):
            stashpoint.read(tmp_path / "deep", select=select)
    assert stashpoint.read(tmp_path / "deep", select="run/ok") == [1, 2]
    target: dict = {}
    stashpoint.load(target, tmp_path / "ck", allow_pickle=True)
    assert target["cfg"] == Fraction(1, 3)
    # Refused before anything is unpickled, not after: unpickling this value makes a directory.
    trap = tmp_path / "UNPICKLED"
    stashpoint.save({"w": torch.ones(2), "obj": _MakesDir(str(trap))}, tmp_path / "trap", allow_pickle=True)
    loads = [
        lambda: stashpoint.load({"w": torch.zeros(2), "obj": None}, tmp_path / "trap"),
        lambda: stashpoint.load({"w": torch.zeros(2)}, tmp_path / "trap", strict=False),
        lambda: stashpoint.load({}, tmp_path / "trap", atomic=True),
        lambda: stashpoint.read(tmp_path / "trap"),
        lambda: stashpoint.read(tmp_path / "trap", select="obj"),
    ]
    for call in loads:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                call()
            except stashpoint.CheckpointError as e:
                assert "pickled value" in str(e)
        assert not trap.exists(), "a value was unpickled without allow_pickle=True"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA path (pinned staging, side stream): needs a GPU")
def test_cuda_tensors_round_trip_through_pinned_staging(tmp_path):
    state = {"w": torch.randn(1000, device="cuda"), "b": torch.randn(10, dtype=torch.bfloat16, device="cuda")}
    want = {k: v.clone() for k, v in state.items()}
    h = stashpoint.async_save(state, tmp_path / "ck")
    state["w"].add_(1)  # the staged copy is already taken
    h.wait()
    target = {"w": torch.zeros(1000, device="cuda"), "b": torch.zeros(10, dtype=torch.bfloat16, device="cuda")}
    stashpoint.load(target, tmp_path / "ck")
    assert all(torch.equal(target[k], want[k]) for k in want)  # (w + 1) - 1 is not w in floating point


def test_optimizer_state_loads_in_place_when_it_exists(tmp_path):
    model = small_model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, optim, 2)
    stashpoint.save({"model": model, "optim": optim}, tmp_path / "ck")
    train_steps(model, optim, 3, seed=4)  # the live state moves on
    before = {id(p): {k: v.data_ptr() for k, v in st.items()} for p, st in optim.state.items()}
    stashpoint.load({"model": model, "optim": optim}, tmp_path / "ck")
    after = {id(p): {k: v.data_ptr() for k, v in st.items()} for p, st in optim.state.items()}
    assert before == after, "exp_avg / exp_avg_sq / step were read into the existing tensors"
    model2 = small_model()
    optim2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    stashpoint.load({"model": model2, "optim": optim2}, tmp_path / "ck")  # fresh optimizer: allocated
    assert_same(optim.state_dict(), optim2.state_dict())


class Untied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)


def test_a_tied_model_refuses_an_untied_checkpoint_of_other_values_and_a_lenient_load_takes_one(tmp_path):
    """Before: both saved tensors were written into the one live tensor, and the embedding came
    back as the saved head, with no error (torch's load_state_dict does the same)."""
    src = Untied()
    stashpoint.save({"model": src}, tmp_path / "ck")
    tied = Tied()
    before = tied.emb.weight.detach().clone()
    with pytest.raises(stashpoint.StateMismatchError, match=r"'model/head.weight' and 'model/emb.weight'.*untie"):
        stashpoint.load({"model": tied}, tmp_path / "ck")
    assert torch.equal(tied.emb.weight, before), "nothing is read when the load is refused"
    with pytest.warns(UserWarning, match="tied weights"):
        stashpoint.load({"model": tied}, tmp_path / "ck", strict=False)  # one memory: no concurrent reads into it
    assert tied.head.weight is tied.emb.weight
    assert torch.equal(tied.emb.weight, src.emb.weight), "the first key's values, the one the message names"
    # a flat buffer at the same address first (another layout) does not hide the two tied views
    stashpoint.save({"flat": torch.arange(4.0), "a": torch.ones(2, 2), "b": torch.full((2, 2), 2.0)}, tmp_path / "f")
    flat = torch.zeros(4)
    with pytest.raises(stashpoint.StateMismatchError, match="'b' and 'a'"):
        stashpoint.load({"flat": flat, "a": flat.view(2, 2), "b": flat.view(2, 2)}, tmp_path / "f")
    same = Untied()
    same.head.weight.data.copy_(same.emb.weight)  # saved untied, but of one value: loads quietly
    stashpoint.save({"model": same}, tmp_path / "same")
    stashpoint.load({"model": Tied()}, tmp_path / "same")


def test_conjugate_views_are_not_aliased_and_load_right(tmp_path):
    x = torch.randn(4, dtype=torch.complex64)
    stashpoint.save({"a": x, "b": x.conj()}, tmp_path / "ck")
    out = {"a": torch.zeros(4, dtype=torch.complex64), "b": torch.zeros(4, dtype=torch.complex64)}
    stashpoint.load(out, tmp_path / "ck")
    assert torch.equal(out["a"], x) and torch.equal(out["b"], x.conj().resolve_conj())
    dest = torch.zeros(4, dtype=torch.complex64)
    stashpoint.load({"a": dest.conj(), "b": torch.zeros(4, dtype=torch.complex64)}, tmp_path / "ck")
    assert torch.equal(dest.conj().resolve_conj(), x)
    # loaded in the form it was saved: a tensor and its conjugate view are not one tensor twice
    dest = torch.zeros(4, dtype=torch.complex64)
    stashpoint.load({"a": dest, "b": dest.conj()}, tmp_path / "ck")
    assert torch.equal(dest, x)
    y = torch.randn(4)
    stashpoint.save({"a": y, "b": y._neg_view()}, tmp_path / "neg")
    dest = torch.zeros(4)
    stashpoint.load({"a": dest, "b": dest._neg_view()}, tmp_path / "neg")
    assert torch.equal(dest, y)


def test_odd_destinations_get_clear_answers(tmp_path):
    stashpoint.save({"p": torch.arange(6.0).reshape(2, 3), "n": 5}, tmp_path / "ck")
    param = torch.nn.Parameter(torch.zeros(3, 2))
    stashpoint.load({"p": param.t(), "n": 0}, tmp_path / "ck")  # a view of a leaf that requires grad
    assert torch.equal(param.t(), torch.arange(6.0).reshape(2, 3))
    with pytest.raises(stashpoint.StateMismatchError, match=r"meta device.*to_empty"):
        stashpoint.load({"p": torch.empty(2, 3, device="meta"), "n": 0}, tmp_path / "ck")
    stashpoint.save((torch.ones(2), 5), tmp_path / "tup")
    with pytest.raises(stashpoint.StateMismatchError, match="a tuple, or a plain value at its root"):
        stashpoint.load((torch.zeros(2), 0), tmp_path / "tup")
    with pytest.raises(stashpoint.UnsupportedStateError, match="reserved by the safetensors layout"):
        stashpoint.save({"__metadata__": torch.ones(1)}, tmp_path / "meta")


def test_raw_state_dicts_load_into_live_objects(tmp_path):
    """What `stashpoint import` makes of a torch.save file: plain dicts of tensors."""
    model = small_model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_steps(model, optim, 2)
    stashpoint.save({"model": model.state_dict(), "optim": optim.state_dict()}, tmp_path / "ck")
    model2 = small_model(seed=9)
    optim2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    stashpoint.load({"model": model2, "optim": optim2}, tmp_path / "ck")
    assert_same(model.state_dict(), model2.state_dict())
    assert_same(optim.state_dict(), optim2.state_dict())


@pytest.mark.parametrize("stepped", [False, True], ids=["before-the-first-step", "after-two-steps"])
def test_state_dicts_without_tensors_load_into_live_objects(tmp_path, stepped):
    """A scheduler's state dict, and an optimizer's before its first step, hold no tensor: saved
    as dicts (as `stashpoint import` makes them of a torch.save file) they load into the live
    scheduler and optimizer."""
    model = small_model()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    if stepped:
        for _ in range(2):
            train_steps(model, optim, 1)
            sched.step()
    state = {"model": model.state_dict(), "optim": optim.state_dict(), "sched": sched.state_dict()}
    stashpoint.save(state, tmp_path / "ck")
    model2 = small_model(seed=9)
    optim2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.StepLR(optim2, step_size=1, gamma=0.5)
    stashpoint.load({"model": model2, "optim": optim2, "sched": sched2}, tmp_path / "ck")
    assert sched2.state_dict() == sched.state_dict() and sched2.get_last_lr() == sched.get_last_lr()
    assert_same(optim.state_dict(), optim2.state_dict())
    with pytest.raises(stashpoint.StateMismatchError, match="'sched': the saved state does not fit this LambdaLR"):
        stashpoint.load(
            {"sched": torch.optim.lr_scheduler.LambdaLR(optim2, lambda s: 1.0)}, tmp_path / "ck", partial=True
        )
    with pytest.warns(UserWarning, match="with strict=False it is not loaded.*its schedule starting over"):
        stashpoint.load(
            {"sched": torch.optim.lr_scheduler.LambdaLR(optim2, lambda s: 1.0)}, tmp_path / "ck", partial=True,
            strict=False,
        )  # fmt: skip


def test_a_program_without_dtensors_does_not_import_them_through_stashpoint(tmp_path):
    """DTensor's module takes 0.7 s to import; no DTensor exists before it is imported, so a
    save, a load and a manager's restore of a plain model (an evaluation job loading weights)
    leave it (and FSDP) unimported. (Creating a torch optimizer imports them, through
    torch._dynamo: none is made here.)"""
    import subprocess
    import sys

    code = f"""
import sys, torch, stashpoint
m = torch.nn.Linear(4, 4)
state = {{"model": m, "step": torch.tensor(3), "epoch": 2}}
stashpoint.save(state, {str(tmp_path / "c")!r})
stashpoint.load(state, {str(tmp_path / "c")!r})
with stashpoint.CheckpointManager({str(tmp_path / "run")!r}) as mgr:
    mgr.save(1, state)
    mgr.wait()
    assert mgr.restore(state) == 1
print(sorted(k for k in ("torch.distributed.tensor", "torch.distributed.fsdp") if k in sys.modules))
"""
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_an_empty_param_group_keeps_its_hyperparameters(tmp_path):
    """A decay/no-decay split of a model without biases leaves the no-decay group empty (LoRA
    with bias-free adapters too): it has no parameter to be matched by, and loaded without its
    lr and betas the first step raised KeyError."""

    def build():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 2, bias=False))
        ps = list(model.parameters())
        groups = [{"params": [p for p in ps if p.ndim >= 2], "weight_decay": 0.1}, {"params": [], "weight_decay": 0.0}]
        return model, torch.optim.AdamW(groups, lr=1e-3)

    model, optim = build()
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    optim.param_groups[1]["lr"] = 0.123  # as a scheduler leaves it
    stashpoint.save({"model": model, "optim": optim}, tmp_path / "c")
    model2, optim2 = build()
    stashpoint.load({"model": model2, "optim": optim2}, tmp_path / "c")
    assert optim2.param_groups[1]["lr"] == 0.123 and optim2.param_groups[1]["betas"] == (0.9, 0.999)
    assert optim2.param_groups[1]["params"] == []
    model2(torch.randn(3, 4)).sum().backward()
    optim2.step()


def test_a_model_whose_blocks_are_compiled_one_by_one_saves_and_loads_under_plain_names(tmp_path):
    """``layers[i] = torch.compile(layers[i])`` (the FSDP2 recipe) puts ``_orig_mod.`` inside the
    keys: saved without it, as DCP's get_model_state_dict does, the checkpoint loads into the
    plain model and back; one written with those keys (a state dict saved as such) loads too."""

    def build(compiled: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        blocks = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)]
        if compiled:
            blocks = [torch.compile(b, backend="eager") for b in blocks]
        return torch.nn.Sequential(*blocks)

    compiled = build(True)
    assert any("_orig_mod" in k for k in compiled.state_dict())
    stashpoint.save({"model": compiled}, tmp_path / "c")
    assert set(stashpoint.read(tmp_path / "c")["model"]) == set(build(False).state_dict())
    for target in (build(False), build(True)):
        with torch.no_grad():
            for p in target.parameters():
                p.zero_()
        stashpoint.load({"model": target}, tmp_path / "c")
        assert all(torch.equal(a, b) for a, b in zip(target.parameters(), compiled.parameters()))
    stashpoint.save({"model": compiled.state_dict()}, tmp_path / "raw")  # the keys as they are
    plain = build(False)
    with torch.no_grad():
        plain[0].weight.zero_()
    stashpoint.load({"model": plain}, tmp_path / "raw")
    assert torch.equal(plain[0].weight, compiled[0].weight)


def test_strict_false_loads_the_optimizer_state_of_the_parameters_both_have(tmp_path):
    """Progressive unfreezing: saved with the first layer frozen (not in the optimizer), resumed
    with every layer trainable. strict=False loads the moments of the parameters the checkpoint
    has and starts the others fresh (it dropped the whole optimizer's state)."""

    def build(frozen: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        params = [p for i, p in enumerate(model.parameters()) if not (frozen and i < 2)]
        return model, torch.optim.AdamW(params, lr=1e-3)

    model, optim = build(frozen=True)
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    stashpoint.save({"model": model, "optim": optim}, tmp_path / "c")
    model2, optim2 = build(frozen=False)
    with pytest.raises(stashpoint.StateMismatchError, match=r"missing optimizer parameter '0\.weight'") as info:
        stashpoint.load({"model": model2, "optim": optim2}, tmp_path / "c")
    assert "(2 problem(s))" in str(info.value) and "the others start fresh" in str(info.value), info.value
    with pytest.warns(UserWarning, match="the others start fresh"):
        stashpoint.load({"model": model2, "optim": optim2}, tmp_path / "c", strict=False)
    assert len(optim2.state) == 2
    for p, p2 in zip(list(model.parameters())[2:], list(model2.parameters())[2:]):
        assert torch.equal(optim.state[p]["exp_avg"], optim2.state[p2]["exp_avg"])
    model2(torch.randn(3, 4)).sum().backward()
    optim2.step()
    assert len(optim2.state) == 4


@pytest.mark.parametrize("before", [2, 1])
def test_strict_false_leaves_a_resized_parameters_optimizer_state_fresh(tmp_path, before):
    """A head resized between runs: its saved moments are of the old shape. strict=False loads
    the others' and starts the head's fresh (they were loaded, and the first step failed; from
    a size of 1 too, which a first rule for factored state took for a factor)."""

    def build(out: int):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, out))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    model, optim = build(before)
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    stashpoint.save({"optim": optim, "model": model}, tmp_path / "c")
    model2, optim2 = build(3)
    with pytest.warns(UserWarning, match=rf"'1\.weight'.*'exp_avg' is \[{before}, 4\], the parameter \[3, 4\]"):
        stashpoint.load({"optim": optim2, "model": model2}, tmp_path / "c", strict=False)
    assert sorted(tuple(optim2.state[p]["exp_avg"].shape) for p in optim2.state) == [(4,), (4, 4)]
    model2(torch.randn(3, 4)).sum().backward()
    optim2.step()


def test_a_dcp_named_optimizer_dict_loads_by_position_into_a_state_without_the_model(tmp_path):
    """get_state_dict's optimizer dict loaded beside the model's state dict (no module to name
    the parameters by): paired by position, as torch's load_state_dict pairs them."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    stashpoint.save({"model": msd, "optim": osd}, tmp_path / "c")
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optim2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    stashpoint.load({"model": model2.state_dict(), "optim": optim2}, tmp_path / "c")
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(optim.state[p]["exp_avg"], optim2.state[p2]["exp_avg"])


_OPTIM_JOB = """
import sys, torch, stashpoint
kind, mode, ck, out = sys.argv[1:5]
torch.manual_seed(0)
model = torch.nn.Sequential(  # a square weight too: its two factors have one shape
    torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)
)
if kind == "adafactor":
    optim = torch.optim.Adafactor(model.parameters(), lr=1e-2)
elif kind == "hf_adafactor":  # transformers' (T5 recipes): factors [n] and [m] of an [n, m] weight
    from transformers.optimization import Adafactor
    optim = Adafactor(model.parameters(), lr=1e-2, relative_step=False, scale_parameter=False)
else:
    optim = torch.optim.LBFGS(model.parameters(), lr=0.5, history_size=4, max_iter=3)
x, y = torch.randn(32, 8, generator=torch.Generator().manual_seed(1)), torch.randn(32, 4)

def closure():
    optim.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss

state = {"model": model, "optim": optim}
if mode == "resume":
    stashpoint.load(state, ck)
for _ in range(3 if mode != "straight" else 6):
    if kind == "hf_adafactor":  # its step() calls a closure under no_grad
        closure()
        optim.step()
    else:
        optim.step(closure)
if mode == "first":
    stashpoint.save(state, ck)
else:
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, out)
"""


@pytest.mark.parametrize("kind", ["adafactor", "hf_adafactor", "lbfgs"])
def test_optimizers_whose_state_is_not_shaped_like_their_parameters_resume_exactly(tmp_path, kind):
    """Before: Adafactor's factored statistics (``[n, 1]`` of an ``[n, m]`` weight) were taken for
    a resized parameter's and refused, and LBFGS's history (lists of tensors) for no optimizer
    state at all: neither could be resumed, strict or not. transformers' Adafactor (``[n]`` and
    ``[m]``) made the check itself fail with an IndexError."""
    import subprocess
    import sys

    if kind == "hf_adafactor":
        pytest.importorskip("transformers")
    # the rest of the environment kept: a CUDA build of torch may find its libraries through it
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    ck, straight, resumed = tmp_path / "ck", tmp_path / "straight.pt", tmp_path / "resumed.pt"
    for mode, out in (("straight", straight), ("first", None), ("resume", resumed)):
        args = [sys.executable, "-c", _OPTIM_JOB, kind, mode, str(ck), str(out)]
        r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
    a, b = torch.load(straight, weights_only=True), torch.load(resumed, weights_only=True)
    assert_same(a["model"], b["model"])
    assert_same(a["optim"], b["optim"])


class _ChildCalledModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())  # the user's own name
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.module(x))


def _trained_child_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = _ChildCalledModule()
    optim = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(3, 4)).sum().backward()
    optim.step()
    return m, optim


def test_a_submodule_called_module_keeps_its_name_in_the_optimizers_state(tmp_path, monkeypatch):
    """Before: every 'module' part was taken for DDP's and left out of the optimizer's names
    ('0.weight'), unlike the model's keys and DCP's ('module.0.weight'): DCP's optimizer state
    dict did not load. Checkpoints named the old way still load."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from stashpoint._state import stateful

    m, optim = _trained_child_model()
    stashpoint.save({"model": m, "optim": optim}, tmp_path / "c")
    assert sorted(stashpoint.read(tmp_path / "c")["optim"]["state"]) == sorted(
        get_optimizer_state_dict(m, optim)["state"]
    )
    stashpoint.save({"model": m.state_dict(), "optim": get_optimizer_state_dict(m, optim)}, tmp_path / "dcp-form")
    original = stateful.param_names
    monkeypatch.setattr(stateful, "param_names", lambda modules, **_: original(modules, legacy=True))
    stashpoint.save({"model": m, "optim": optim}, tmp_path / "old")
    assert "0.weight" in stashpoint.read(tmp_path / "old")["optim"]["state"]
    monkeypatch.undo()
    for ck in ("old", "dcp-form"):
        torch.manual_seed(1)
        m2 = _ChildCalledModule()
        o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
        stashpoint.load({"model": m2, "optim": o2}, tmp_path / ck)
        for p, q in zip(m.parameters(), m2.parameters()):
            assert torch.equal(optim.state[p]["exp_avg"], o2.state[q]["exp_avg"]), ck


def test_an_optimizer_built_from_named_parameters_keeps_the_models_names_after_a_load(tmp_path):
    m, _ = _trained_child_model()
    wrapped = torch.optim.AdamW([(f"module.{n}", p) for n, p in m.named_parameters()], lr=1e-2)  # as under DDP
    stashpoint.save({"model": m, "optim": wrapped}, tmp_path / "c")
    m2 = _ChildCalledModule()
    o2 = torch.optim.AdamW(m2.named_parameters(), lr=1e-2)
    stashpoint.load({"model": m2, "optim": o2}, tmp_path / "c")
    assert o2.param_groups[0]["param_names"] == [n for n, _ in m2.named_parameters()]


def test_a_relative_path_is_where_the_call_was_made_not_where_the_process_went_since(tmp_path, monkeypatch):
    """The files of an ``async_save`` are written later on another thread, and a manager saves
    long after it opened: a ``chdir`` meanwhile must not send them elsewhere."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    gate = threading.Event()
    get_engine().executor.submit(gate.wait, 30)  # the save's writes wait until after the chdir
    handle = stashpoint.async_save({"w": torch.ones(4)}, "ck")
    mgr = stashpoint.CheckpointManager("run")
    monkeypatch.chdir(tmp_path / "b")
    gate.set()
    handle.wait()
    mgr.save(1, {"w": torch.ones(4)}).wait()
    mgr.close()
    assert (tmp_path / "a" / "ck" / "manifest.json").is_file()
    assert (tmp_path / "a" / "run" / "step-00000001" / "manifest.json").is_file()
    assert list((tmp_path / "b").iterdir()) == []


def _grouped(model: torch.nn.Module, order: tuple[list[str], ...], lrs: tuple[float, ...]) -> torch.optim.AdamW:
    by_name = dict(model.named_parameters())
    return torch.optim.AdamW(
        [{"params": [by_name[n] for n in names], "lr": lr, "weight_decay": lr * 10} for names, lr in zip(order, lrs)]
    )


@pytest.mark.parametrize(
    ("order", "lrs", "why"),
    [
        # the usual no-decay list grown by one name: the first group now starts with a decayed weight
        ((["2.weight"], ["0.weight", "0.bias", "2.bias"]), (0.1, 0.01), "holds parameters of saved groups 0 and 1"),
        ((["0.weight"], ["2.weight"], ["0.bias", "2.bias"]), (0.1, 0.1, 0.01), "2 parameter group.s., the optimizer 3"),
        ((["0.bias", "2.bias"], ["0.weight", "2.weight"]), (0.01, 0.1), "in another order"),
    ],
)
def test_optimizer_groups_formed_otherwise_are_refused_not_guessed(tmp_path, order, lrs, why):
    """Each group takes its lr and weight decay from a saved group, and an LR scheduler keeps its
    per-group state by position: before, a group holding parameters of two saved groups took the
    hyperparameters of its first parameter's, and groups listed in another order loaded while
    their scheduler's per-group state did not follow (lrs swapped one step later), silently."""
    model = small_model()
    optim = _grouped(model, (["0.weight", "2.weight"], ["0.bias", "2.bias"]), (0.1, 0.01))
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda e: 1.0 - e / 20)
    train_steps(model, optim, 1)
    stashpoint.save({"model": model, "optim": optim, "sched": sched}, tmp_path / "ck")

    fresh = small_model(seed=3)
    optim2 = _grouped(fresh, order, lrs)
    state = {"model": fresh, "optim": optim2, "sched": torch.optim.lr_scheduler.LambdaLR(optim2, lambda e: 1.0)}
    with pytest.raises(stashpoint.StateMismatchError, match=why):
        stashpoint.load(state, tmp_path / "ck")
    # the same groups in the same order, parameters listed otherwise within them, still load
    optim3 = _grouped(fresh, (["2.weight", "0.weight"], ["2.bias", "0.bias"]), (0.5, 0.5))
    stashpoint.load({"model": fresh, "optim": optim3}, tmp_path / "ck", partial=True)
    assert [g["lr"] for g in optim3.param_groups] == [g["lr"] for g in optim.param_groups]


def test_regroup_problem_names_each_way_groups_can_be_formed_otherwise():
    from stashpoint._state.validate import regroup_problem

    def groups(*spec):
        return [{"params": names, "lr": lr, "initial_lr": 9.0} for names, lr in spec]

    saved = groups((["a", "b"], 0.1), (["c"], 0.01), ([], 0.1))
    assert regroup_problem(saved, groups((["b", "a"], 0.5), (["c"], 0.5), ([], 0.5))) is None, "order within: free"
    assert regroup_problem(saved, groups((["a", "b"], 0.1), (["c", "new"], 0.1), (["old"], 0.1))) is None
    assert "saved groups 0 and 1, whose" in (
        regroup_problem(saved, groups((["a", "c"], 0.1), (["b"], 0.1), ([], 1))) or ""
    )
    shared = regroup_problem(saved, groups((["a"], 0.1), (["b"], 0.2), ([], 0.1))) or ""
    assert "groups 0 and 1 both hold parameters of saved group 0" in shared
    assert regroup_problem(saved, groups((["a"], 0.1), (["b"], 0.1), ([], 0.1))) is None, "alike: both take its lr"
    assert "group 0 holds the parameters of saved group 1" in (
        regroup_problem(saved, groups((["c"], 1), (["a", "b"], 1), ([], 1))) or ""
    )
    alike = groups((["a", "b"], 0.1), (["c"], 0.1), ([], 0.1))
    assert regroup_problem(alike, groups((["a", "c"], 0.1), (["b"], 0.1), ([], 0.1))) is None, "saved alike: no guess"
    assert regroup_problem(alike, groups((["c"], 0.1), (["a", "b"], 0.1), ([], 0.1))) is None


def test_partial_skips_the_saved_state_of_parameters_the_optimizer_no_longer_holds(tmp_path):
    """A fine-tuning stage that freezes part of what the last one trained: partial=True skips
    the frozen parameters' optimizer state as it skips keys, and loads the rest exactly."""
    model = small_model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, optim, 2)
    stashpoint.save({"model": model, "optim": optim}, tmp_path / "ck")

    fresh = small_model(seed=3)
    fresh[0].requires_grad_(False)
    optim2 = torch.optim.AdamW(fresh[2].parameters(), lr=0.5)
    with pytest.raises(stashpoint.StateMismatchError, match=r"unexpected optimizer parameter '0\.weight'"):
        stashpoint.load({"model": fresh, "optim": optim2}, tmp_path / "ck")
    stashpoint.load({"model": fresh, "optim": optim2}, tmp_path / "ck", partial=True)
    saved = dict(model.named_parameters())
    for name, p in fresh[2].named_parameters():
        assert torch.equal(optim2.state[p]["exp_avg"], optim.state[saved[f"2.{name}"]]["exp_avg"]), name
    assert optim2.param_groups[0]["lr"] == 1e-2


class _OwnSGD(torch.optim.SGD):
    """An optimizer class outside torch.optim (transformers' Adafactor, a fused variant)."""


def test_a_state_that_does_not_fit_another_libraries_optimizer_names_both_classes(tmp_path):
    model = small_model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, optim, 1)
    stashpoint.save({"model": model, "optim": optim}, tmp_path / "ck")
    fresh = small_model(seed=3)
    with pytest.raises(
        stashpoint.StateMismatchError,
        match=r"of class torch\.optim\.adamw\.AdamW, the state holds one of class .*_OwnSGD",
    ):
        stashpoint.load({"model": fresh, "optim": _OwnSGD(fresh.parameters(), lr=0.1)}, tmp_path / "ck")


class _ProjectAdamW(torch.optim.AdamW):
    """A project's own subclass (a log line, a hook): the same hyperparameters as AdamW."""


def _as_older_torch(_optim, sd):  # what an AdamW of an older torch saved: keys added since left out
    for g in sd["param_groups"]:
        for k in ("decoupled_weight_decay", "fused", "differentiable"):
            g.pop(k, None)
    return sd


def test_a_subclass_takes_an_older_torchs_state_that_its_class_fills_in(tmp_path):
    """The class of the state differs (a subclass), and the saved groups lack keys a later torch
    added: torch's load fills them in (``__setstate__``), so the state fits."""
    model = small_model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optim.register_state_dict_post_hook(_as_older_torch)
    train_steps(model, optim, 1)
    stashpoint.save({"model": model, "optim": optim}, tmp_path / "ck")
    fresh = small_model(seed=3)
    optim2 = _ProjectAdamW(fresh.parameters(), lr=0.5)
    torch.optim.lr_scheduler.LambdaLR(optim2, lambda e: 1.0)  # built before the load: adds initial_lr
    stashpoint.load({"model": fresh, "optim": optim2}, tmp_path / "ck")
    assert optim2.param_groups[0]["lr"] == 1e-2 and optim2.param_groups[0]["decoupled_weight_decay"] is True
    train_steps(fresh, optim2, 1)


def test_groups_alike_in_every_hyperparameter_may_be_formed_anew(tmp_path):
    """Trainer-style groups whose weight decay is 0 in both: moving a name between them changes
    nothing a load could get wrong."""
    model = small_model()
    optim = _grouped(model, (["0.weight", "2.weight"], ["0.bias", "2.bias"]), (0.1, 0.1))
    for g in optim.param_groups:
        g["weight_decay"] = 0.0
    train_steps(model, optim, 1)
    stashpoint.save({"model": model, "optim": optim}, tmp_path / "ck")
    fresh = small_model(seed=3)
    optim2 = _grouped(fresh, (["0.weight"], ["2.weight", "0.bias", "2.bias"]), (0.1, 0.1))
    stashpoint.load({"model": fresh, "optim": optim2}, tmp_path / "ck")
    assert [g["weight_decay"] for g in optim2.param_groups] == [0.0, 0.0]


def test_partial_skips_a_group_whose_parameters_were_all_frozen(tmp_path):
    model = small_model()
    optim = _grouped(model, (["0.weight", "0.bias"], ["2.weight", "2.bias"]), (0.1, 0.01))
    train_steps(model, optim, 1)
    stashpoint.save({"model": model, "optim": optim}, tmp_path / "ck")
    fresh = small_model(seed=3)
    fresh[0].requires_grad_(False)
    optim2 = torch.optim.AdamW(fresh[2].parameters(), lr=0.5, weight_decay=0.1)
    stashpoint.load({"model": fresh, "optim": optim2}, tmp_path / "ck", partial=True)
    assert optim2.param_groups[0]["lr"] == 0.01
    assert torch.equal(optim2.state[fresh[2].weight]["exp_avg"], optim.state[model[2].weight]["exp_avg"])


def test_a_torch_class_that_moved_module_is_the_same_class():
    from stashpoint._state.stateful import saved_from_other_class

    optim = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    assert not saved_from_other_class("torch.optim.adamw.AdamW", optim)
    assert not saved_from_other_class("torch.optim._adamw.AdamW", optim)
    assert not saved_from_other_class(None, optim)
    assert saved_from_other_class("transformers.optimization.AdamW", optim)


def _save_with_tensor_lrs(path):
    """Weights at a tensor lr of 0.1, biases at 0.001 (a compiled optimizer's tensor lr)."""
    model = small_model()
    optim = torch.optim.AdamW(
        [
            {"params": [model[0].weight, model[2].weight], "lr": torch.tensor(0.1)},
            {"params": [model[0].bias, model[2].bias], "lr": torch.tensor(0.001)},
        ]
    )
    train_steps(model, optim, 1)
    stashpoint.save({"model": model, "optim": optim}, path)


def test_regrouping_groups_of_tensor_valued_hyperparameters_is_refused(tmp_path):
    """A tensor lr (capturable Adam) is read after planning: groups holding one are never taken
    for alike, so a merge of two saved groups whose lrs differ is refused, not loaded at one."""
    _save_with_tensor_lrs(tmp_path / "ck")
    fresh = small_model(seed=3)
    merged = torch.optim.AdamW(
        [
            {"params": [fresh[0].weight, fresh[0].bias], "lr": torch.tensor(0.5)},
            {"params": [fresh[2].weight, fresh[2].bias], "lr": torch.tensor(0.5)},
        ]
    )
    with pytest.raises(stashpoint.StateMismatchError, match="holds parameters of saved groups 0 and 1"):
        stashpoint.load({"model": fresh, "optim": merged}, tmp_path / "ck")


def test_partial_pairs_an_empty_group_with_the_group_whose_parameters_were_frozen(tmp_path):
    """Groups built with `if p.requires_grad` keep an empty group where the frozen layer's was."""
    model = small_model()
    optim = _grouped(model, (["0.weight", "0.bias"], ["2.weight"], ["2.bias"]), (1e-4, 1e-3, 1e-2))
    train_steps(model, optim, 1)
    stashpoint.save({"model": model, "optim": optim}, tmp_path / "ck")
    fresh = small_model(seed=3)
    fresh[0].requires_grad_(False)
    by_name = dict(fresh.named_parameters())
    spec = ((["0.weight", "0.bias"], 1e-4), (["2.weight"], 1e-3), (["2.bias"], 1e-2))
    optim2 = torch.optim.AdamW(
        [{"params": [by_name[n] for n in names if by_name[n].requires_grad], "lr": lr} for names, lr in spec]
    )
    assert [len(g["params"]) for g in optim2.param_groups] == [0, 1, 1]
    stashpoint.load({"model": fresh, "optim": optim2}, tmp_path / "ck", partial=True)
    assert [g["lr"] for g in optim2.param_groups][1:] == [1e-3, 1e-2]


def test_a_groups_label_is_not_a_hyperparameter(tmp_path):
    model = small_model()
    optim = _grouped(model, (["0.weight", "2.weight"], ["0.bias", "2.bias"]), (0.1, 0.1))
    for g, label in zip(optim.param_groups, ("weights", "biases")):
        g["name"] = label
    train_steps(model, optim, 1)
    stashpoint.save({"model": model, "optim": optim}, tmp_path / "ck")
    fresh = small_model(seed=3)
    optim2 = _grouped(fresh, (["0.weight", "0.bias"], ["2.weight", "2.bias"]), (0.1, 0.1))
    stashpoint.load({"model": fresh, "optim": optim2}, tmp_path / "ck")


def test_groups_sharing_the_default_lr_tensor_each_get_their_own_saved_lr(tmp_path):
    """A tensor lr given as the optimizer's default (as for a compiled optimizer) is one object
    in every group: read in place, each group took the last group's saved lr."""
    _save_with_tensor_lrs(tmp_path / "ck")
    fresh = small_model(seed=3)
    shared = torch.tensor(0.5)
    optim2 = torch.optim.AdamW(
        [{"params": [fresh[0].weight, fresh[2].weight]}, {"params": [fresh[0].bias, fresh[2].bias]}], lr=shared
    )
    assert optim2.param_groups[0]["lr"] is optim2.param_groups[1]["lr"]
    stashpoint.load({"model": fresh, "optim": optim2}, tmp_path / "ck")
    assert [float(g["lr"]) for g in optim2.param_groups] == [float(torch.tensor(0.1)), float(torch.tensor(0.001))]


def _resumes_exactly(tmp_path, build, step, n=6, k=3) -> dict:
    """Losses of ``n`` steps in one go against ``k`` steps, a save, fresh objects (``build()``)
    loaded and the rest: equal, bit for bit (``step(state, i)`` trains step ``i``, gives its
    loss). Returns the state loaded."""
    one = build()
    whole = [step(one, i) for i in range(1, n + 1)]
    first = build()
    for i in range(1, k + 1):
        step(first, i)
    stashpoint.save(first, tmp_path / "resume-ck")
    again = build()
    stashpoint.load(again, tmp_path / "resume-ck")
    assert [step(again, i) for i in range(k + 1, n + 1)] == whole[k:]
    return again


def _train_step(state, i, features=6):
    """One step of ``state``'s model and optimizer (and scheduler) on batch ``i``: its loss."""
    loss = state["model"](torch.randn(8, features, generator=torch.Generator().manual_seed(i))).square().mean()
    state["optim"].zero_grad()
    loss.backward()
    state["optim"].step()
    if "sched" in state:
        state["sched"].step()
    return loss.item()


def test_groups_that_shared_their_lr_tensor_when_saved_share_it_again_and_resume_exactly(tmp_path):
    """Before: the load gave each group a copy; a scheduler's in-place update of one group's lr,
    every group's in the run that saved, then reached one group only, and the losses parted."""

    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        o = torch.optim.Adam([{"params": m[0].parameters()}, {"params": m[2].parameters()}], lr=torch.tensor(0.01))
        s = torch.optim.lr_scheduler.LambdaLR(o, [lambda e: 0.9**e, lambda e: 0.5**e])
        return {"model": m, "optim": o, "sched": s}

    again = _resumes_exactly(tmp_path, build, _train_step, n=8, k=4)
    groups = again["optim"].param_groups
    assert groups[0]["lr"] is groups[1]["lr"]

    def build3():  # three groups on one lr tensor
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 6), torch.nn.Linear(6, 1))
        o = torch.optim.SGD([{"params": layer.parameters()} for layer in m], lr=torch.tensor(0.01))
        s = torch.optim.lr_scheduler.LambdaLR(o, [lambda e: 1.0, lambda e: 0.9**e, lambda e: 0.5**e])
        return {"model": m, "optim": o, "sched": s}

    def step3(state, i):
        if i == 1:  # the first group given an lr tensor of its own by the run: the other two still share
            state["optim"].param_groups[0]["lr"] = torch.tensor(0.01)
        return _train_step(state, i)

    groups = _resumes_exactly(tmp_path / "three", build3, step3, n=8, k=4)["optim"].param_groups
    assert groups[1]["lr"] is groups[2]["lr"] and groups[0]["lr"] is not groups[1]["lr"]


@pytest.mark.parametrize(("inner", "out"), [(16, 1), (1, 8)])
def test_adafactor_on_a_weight_with_a_dimension_of_one_resumes_exactly(tmp_path, inner, out):
    """Weights [1, 16], [1, 6] and [8, 1]. Before: a factor of the weight's own shape ([1, 16]'s
    column) was taken for a whole moment and the other for a misshapen one: a strict load
    refused, strict=False dropped the parameter's state."""

    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(6, inner), torch.nn.Tanh(), torch.nn.Linear(inner, out))
        return {"model": m, "optim": torch.optim.Adafactor(m.parameters(), lr=0.01)}

    _resumes_exactly(tmp_path, build, _train_step)


def test_quantization_aware_training_resumes_exactly_into_observers_not_yet_run(tmp_path):
    """A fresh QAT model's observers hold [0]- and [1]-sized buffers until their first forward;
    their own load_state_dict takes a checkpoint's of any size, as torch's load does. Before:
    refused as mismatched shapes (strict=False skipped them: a resume that was not exact)."""
    import torch.ao.quantization as tq

    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(
            tq.QuantStub(), torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1), tq.DeQuantStub()
        )
        m.train()
        m.qconfig = tq.get_default_qat_qconfig("fbgemm")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's own deprecation notes on its default observers
            tq.prepare_qat(m, inplace=True)
        return {"model": m, "optim": torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)}

    _resumes_exactly(tmp_path, build, _train_step)
    wrong = build()  # a parameter of another shape is still a mismatch
    wrong["model"][1] = torch.nn.Linear(6, 8)
    with pytest.raises(stashpoint.StateMismatchError, match=r"1.weight': the checkpoint holds float32\[16, 6\]"):
        stashpoint.load(wrong, tmp_path / "resume-ck")


def test_an_optimizer_of_ones_own_keeping_flags_and_none_in_its_state_loads_them(tmp_path):
    """Before: its save succeeded and every load refused it ("'warm' of parameter 0 is a bool,
    not a tensor, a number or a list of them"), where torch's load takes it."""

    class WarmSGD(torch.optim.Optimizer):
        def __init__(self, params, lr=0.05):
            super().__init__(params, {"lr": lr})

        @torch.no_grad()
        def step(self):
            for g in self.param_groups:
                for p in g["params"]:
                    st = self.state[p]
                    if not st:
                        st["buf"], st["warm"], st["prev"] = torch.zeros_like(p), True, None
                    st["buf"].mul_(0.9).add_(p.grad)
                    p.add_(st["buf"], alpha=-g["lr"] * (0.1 if st["warm"] else 1.0))
                    st["warm"] = False

    torch.manual_seed(0)
    m = torch.nn.Linear(4, 1)
    o = WarmSGD(m.parameters())
    m(torch.randn(3, 4)).sum().backward()
    o.step()
    stashpoint.save({"model": m, "optim": o}, tmp_path / "ck")
    m2 = torch.nn.Linear(4, 1)
    o2 = WarmSGD(m2.parameters())
    stashpoint.load({"model": m2, "optim": o2}, tmp_path / "ck")
    got = o2.state[m2.weight]
    assert (got["warm"], got["prev"]) == (False, None)
    assert torch.equal(got["buf"], o.state[m.weight]["buf"])


@pytest.mark.parametrize("kind", ["step", "exponential", "multistep", "plateau"])
def test_progressive_unfreezing_with_a_scheduler_resumes_exactly(tmp_path, kind):
    """A group added mid-run (a layer unfrozen) after the scheduler was built: its per-group
    lists then hold fewer values than the optimizer has groups. Before, the load refused them
    against a fresh scheduler's, and strict=False started the schedule over."""

    def build(unfrozen: bool):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        m[0].requires_grad_(False)
        o = torch.optim.AdamW(m[2].parameters(), lr=1e-2)
        s = {
            "step": lambda: torch.optim.lr_scheduler.StepLR(o, 2, 0.5),
            "exponential": lambda: torch.optim.lr_scheduler.ExponentialLR(o, 0.9),
            "multistep": lambda: torch.optim.lr_scheduler.MultiStepLR(o, [2, 5], 0.3),
            "plateau": lambda: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0, min_lr=1e-4),
        }[kind]()
        state = {"model": m, "optim": o, "sched": s}
        if unfrozen:
            unfreeze(state)
        return state

    def unfreeze(state):
        m, o = state["model"], state["optim"]
        m[0].requires_grad_(True)
        o.add_param_group({"params": list(m[0].parameters()), "lr": 1e-3, "initial_lr": 1e-3})

    def step(state, i):
        if i == 2 and len(state["optim"].param_groups) == 1:
            unfreeze(state)
        loss = state["model"](torch.randn(8, 6, generator=torch.Generator().manual_seed(i))).square().mean()
        state["optim"].zero_grad()
        loss.backward()
        state["optim"].step()
        state["sched"].step(1.0) if kind == "plateau" else state["sched"].step()
        return loss.item()

    one = build(False)
    whole = [step(one, i) for i in range(1, 9)]
    first = build(False)
    for i in range(1, 5):
        step(first, i)
    stashpoint.save(first, tmp_path / "ck")
    again = build(True)  # the resume builds as at the start and unfreezes where the run had
    stashpoint.load(again, tmp_path / "ck")
    assert [g["lr"] for g in again["optim"].param_groups] == [g["lr"] for g in first["optim"].param_groups]
    assert [step(again, i) for i in range(5, 9)] == whole[4:]


def test_a_scheduler_of_another_number_of_inner_schedulers_is_still_refused(tmp_path):
    """Only lists of numbers (values per group) may differ in length: SequentialLR's inner
    schedulers' states must still match the live ones, one for one."""

    def sequential(n):
        o = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        inner = [torch.optim.lr_scheduler.ConstantLR(o, 0.5, total_iters=2) for _ in range(n)]
        return torch.optim.lr_scheduler.SequentialLR(o, inner, milestones=list(range(2, 2 * n, 2)))

    stashpoint.save({"sched": sequential(3)}, tmp_path / "ck")
    with pytest.raises(
        stashpoint.StateMismatchError, match=r"'sched'.*_schedulers holds 3 items where the object has 2"
    ):
        stashpoint.load({"sched": sequential(2)}, tmp_path / "ck")
