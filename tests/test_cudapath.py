"""The CUDA path's logic, on the CPU: gathered copies, pinning that fails, RNG device mapping,
capturable optimizers in overlap mode. benchmarks/gpu_check.py proves the same on a GPU."""

from __future__ import annotations

import logging

import pytest
import torch

import stashpoint
from stashpoint._core.plan import TensorSpec, plan_files
from stashpoint._save import cudacopy, overlap, pinning
from stashpoint._save.staging import SharedRegion, StagingPool
from stashpoint._state.rng import cuda_targets

S, L, F = "small", "large", "fence"


def test_adjacent_small_copies_form_runs_and_anything_else_breaks_them():
    items = [(1, 0, 100, S), (1, 128, 100, S), (1, 256, 100, S), (1, 384, 2 << 20, L), (1, 3 << 20, 10, S)]
    runs, singles = cudacopy.plan_runs(items)
    assert runs == [[0, 1, 2]]
    assert sorted(singles) == [3, 4]
    # a fence (another copy's destination) between two small ones splits them; fences never come back
    runs, singles = cudacopy.plan_runs([(1, 0, 64, S), (1, 64, 64, F), (1, 128, 64, S), (1, 192, 64, S)])
    assert runs == [[2, 3]] and singles == [0]
    # other buffers, overlaps and gaps over GAP bytes do not join
    gap = cudacopy.GAP
    runs, _ = cudacopy.plan_runs([(1, 0, 64, S), (2, 64, 64, S), (1, 64 + gap + 1, 8, S)])
    assert runs == []
    # the order given does not matter, only the addresses
    runs, _ = cudacopy.plan_runs([(1, 200, 8, S), (1, 100, 8, S), (1, 0, 8, S)])
    assert runs == [[2, 1, 0]]


def test_a_run_never_spans_more_than_RUN_bytes():
    n = cudacopy.SMALL
    items = [(1, i * n, n, S) for i in range(3 * cudacopy.RUN // n)]
    runs, singles = cudacopy.plan_runs(items)
    assert not singles
    for run in runs:
        assert items[run[-1]][1] + n - items[run[0]][1] <= cudacopy.RUN
    assert sorted(i for r in runs for i in r) == list(range(len(items)))


def _staging(specs):
    plan = plan_files(specs, max_file_bytes=1 << 30)
    return StagingPool().acquire(plan, tuple(specs), None)


def _copy_counting_runs(pairs, fences) -> list[int]:
    """``copy_pairs``; the length of each run it gathered."""
    calls: list[int] = []
    real = cudacopy._gather
    cudacopy._gather = lambda run: (calls.append(len(run)), real(run))[1]
    try:
        cudacopy.copy_pairs(pairs, fences=fences)
    finally:
        cudacopy._gather = real
    return calls


def test_gathered_copies_land_every_byte_and_leave_fences_alone():
    """Many small tensors of every width, a large one, a non-contiguous source, and a fence:
    the copies go through the gather path (CPU tensors stand in for the device)."""
    g = torch.Generator().manual_seed(0)
    srcs = {
        f"t{i}": (torch.randn(n, generator=g) * 100).to(dt)
        for i, (n, dt) in enumerate(
            [
                (3, torch.float32),
                (17, torch.bfloat16),
                (5, torch.int64),
                (9, torch.bool),
                (1, torch.uint8),
                (33, torch.float16),
                (1000, torch.float64),
                (7, torch.int8),
            ]
            * 20
        )
    }
    srcs["big"] = torch.randn(cudacopy.SMALL // 4 + 10, generator=g)
    srcs["strided"] = torch.randn(8, 8, generator=g).t()
    srcs["scalar"] = torch.tensor(3.5)
    srcs["fence"] = torch.zeros(4)
    specs = [
        TensorSpec(k, str(v.dtype).removeprefix("torch."), tuple(v.shape), v.element_size()) for k, v in srcs.items()
    ]
    staged = _staging(specs)
    staged.buffer.fill_(0xAB)  # stale bytes from an earlier layout
    sentinel = torch.full((4,), 42.0)
    staged.views["fence"].copy_(sentinel)
    pairs = [(v, staged.views[k]) for k, v in srcs.items() if k != "fence"]
    calls = _copy_counting_runs(pairs, staged.starts)
    assert calls and sum(calls) >= 150, f"the small tensors were gathered: {calls}"
    for k, v in srcs.items():
        want = sentinel if k == "fence" else v
        assert torch.equal(staged.views[k], want), k


def test_a_run_is_not_gathered_over_a_destination_it_does_not_copy():
    specs = [TensorSpec(f"t{i}", "float32", (4,), 4) for i in range(5)]
    staged = _staging(specs)
    srcs = [torch.full((4,), float(i)) for i in range(5)]
    staged.views["t2"].fill_(42.0)  # copied by someone else (a CPU copy in the call, say)
    pairs = [(srcs[i], staged.views[f"t{i}"]) for i in (0, 1, 3, 4)]
    calls = _copy_counting_runs(pairs, staged.starts)
    assert torch.equal(staged.views["t2"], torch.full((4,), 42.0)), "the other destination is untouched"
    for i in (0, 1, 3, 4):
        assert torch.equal(staged.views[f"t{i}"], srcs[i])
    assert calls == [2, 2], "cut where t2 lies: t0+t1 and t3+t4 gathered, t2 left alone"


def test_a_pin_that_fails_is_reported_warned_once_and_retried(monkeypatch, caplog):
    class Driver:
        def __init__(self):
            self.fail = True
            self.registered: list[int] = []
            self.unregistered: list[int] = []

        def register(self, ptr, nbytes, device):
            if self.fail:
                raise pinning.PinError("cuMemHostRegister failed: out of memory (2)")
            self.registered.append(device)

        def unregister(self, ptr, device):
            self.unregistered.append(device)

    drv = Driver()
    monkeypatch.setattr(pinning, "driver", lambda: drv)
    monkeypatch.setitem(pinning._state, "warned", False)
    with caplog.at_level(logging.DEBUG, logger="stashpoint"):
        a = SharedRegion(1 << 16, pin_device=3)
        b = SharedRegion(1 << 16, pin_device=3)
    assert not a.pinned and not b.pinned
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "could not pin" in r.message]
    assert len(warnings) == 1, "warned once, later failures at debug level"
    assert "out of memory" in warnings[0].message
    assert not a.trimmable or not a.pinned  # unpinned shared memory stays trimmable
    drv.fail = False
    repinned, trimmable = a.repin(), a.trimmable
    assert repinned and drv.registered == [3], "registered for the state's device"
    assert not trimmable, "pinned pages cannot be given back"
    del a
    import gc

    gc.collect()
    assert drv.unregistered == [3], "unpinned when freed, with the same device"


def test_the_pool_retries_a_failed_pin_and_reports_the_real_state(monkeypatch):
    state = {"fail": True}

    def pin(ptr, nbytes, device):
        return not state["fail"]

    monkeypatch.setattr("stashpoint._save.staging.pin", pin)
    monkeypatch.setattr("stashpoint._save.staging.unpin", lambda ptr, device: None)
    specs = (TensorSpec("w", "float32", (1000,), 4),)
    plan = plan_files(list(specs), max_file_bytes=1 << 30)
    pool = StagingPool()
    first = pool.acquire(plan, specs, 0)
    assert first.pin_device == 0 and not first.pinned, "asked for pinned memory, did not get it, says so"
    pool.release(first)
    state["fail"] = False
    again = pool.acquire(plan, specs, 0)
    assert again.buffer.data_ptr() == first.buffer.data_ptr(), "the same buffer, reused"
    assert again.pinned, "pinned on reuse once CUDA agrees"
    pool.release(again)
    assert pool.acquire(plan, specs, None).buffer.data_ptr() != first.buffer.data_ptr(), "pageable kept apart"


def test_a_pinned_buffer_too_large_for_its_layout_is_used_then_replaced_on_release(monkeypatch):
    monkeypatch.setattr("stashpoint._save.staging.pin", lambda ptr, nbytes, device: True)
    monkeypatch.setattr("stashpoint._save.staging.unpin", lambda ptr, device: None)
    whole = tuple(TensorSpec(f"w{i}", "float32", (1 << 18,), 4) for i in range(8))  # 8 MiB
    mine = whole[:2]  # a DDP rank's second save copies only its share
    pool = StagingPool()
    a = pool.acquire(plan_files(list(whole), max_file_bytes=1 << 30), whole, 0)
    pool.release(a)
    b = pool.acquire(plan_files(list(mine), max_file_bytes=1 << 30), mine, 0)
    assert b.buffer.data_ptr() == a.buffer.data_ptr() and pool.allocations == 1, "no fresh pinning in the call"
    assert b.shrink
    pool.release(b)
    c = pool.acquire(plan_files(list(mine), max_file_bytes=1 << 30), mine, 0)
    assert c.nbytes < a.nbytes // 2 and pool.allocations == 2, "replaced by one of the right size on release"
    assert not c.shrink


def test_a_cpu_state_reports_no_pinning():
    stats = stashpoint.async_save({"w": torch.ones(4)}, _tmp()).wait()
    assert stats.staging_pinned is None


def _tmp():
    import tempfile
    from pathlib import Path

    return Path(tempfile.mkdtemp()) / "ck"


def test_cuda_rng_states_follow_the_current_device_not_the_index():
    # saved by rank 3 of 8 visible GPUs; resumed where the rank sees only its own GPU (index 0)
    assert cuda_targets(8, 3, 1, 0) == [(3, 0)]
    # the same devices and the same current one: all by index
    assert cuda_targets(2, 1, 2, 1) == [(0, 0), (1, 1)]
    # the same count but another current device: only the current one
    assert cuda_targets(4, 2, 4, 0) == [(2, 0)]
    # a checkpoint from before the current device was recorded: by index, as before
    assert cuda_targets(3, None, 2, 0) == [(0, 0), (1, 1)]


def test_an_rng_state_with_a_current_device_out_of_range_is_refused():
    rng = stashpoint.RNGState()
    sd = rng.state_dict()
    sd["cuda"] = [bytes(16)]
    sd["cuda_current"] = 5
    assert "current CUDA device" in (rng._stashpoint_check(sd) or "")
    sd["cuda_current"] = 0
    assert rng._stashpoint_check(sd) is None


def test_overlap_copies_a_capturable_optimizers_tensors_eagerly():
    model = torch.nn.Linear(4, 4)
    other = torch.nn.Linear(4, 4)
    graphed = torch.optim.Adam(model.parameters(), capturable=True)
    plain = torch.optim.SGD(other.parameters(), lr=0.1)
    triples = [(f"k{i}", p, torch.empty_like(p)) for i, p in enumerate([*model.parameters(), *other.parameters()])]
    eager, deferred = overlap.split(triples, [graphed, plain])
    assert [k for k, _, _ in eager] == ["k0", "k1"], "the capturable optimizer's parameters are copied in the call"
    assert [k for k, _, _ in deferred] == ["k2", "k3"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_failed_pin_leaves_no_cuda_error_for_the_next_kernel():
    """CUDA refuses to pin a null range; the training's next kernel must not see that error
    (the runtime's cudaHostRegister left it set). A range registered twice is no failure: the
    driver accepted it on an H200."""
    region = SharedRegion(1 << 20, pin_device=torch.cuda.current_device())
    assert region.pinned
    assert not pinning.pin(0, 1 << 20, torch.cuda.current_device())
    x = torch.ones(16, device="cuda") * 2  # raised "CUDA error: ... already registered" before
    torch.cuda.synchronize()
    assert float(x.sum()) == 32.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_saving_while_capturing_a_graph_is_refused():
    w = torch.ones(8, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with pytest.raises(stashpoint.CheckpointError, match="graph is being captured"), torch.cuda.graph(g, stream=s):
            w.mul_(2)
            stashpoint.async_save({"w": w}, _tmp())
