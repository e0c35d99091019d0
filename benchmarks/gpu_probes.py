"""The probes of ``benchmarks/gpu_check.py`` that need a CUDA device: ordering races with
controls that must fail, loads into fresh optimizers (one GPU, FSDP2 over NCCL), pinned host
memory of a load, GradScaler, many small tensors, DCP ``async_save`` with its pinned stager."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import stashpoint
from stashpoint._save import cudacopy, overlap, staging


class Net(torch.nn.Module):
    """Linear layers (parameters) and a BatchNorm (buffers: eager copies in overlap mode)."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
        self.norm = torch.nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.norm(x)


def build(width: int, layers: int, seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = Net(width, layers).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12, growth_interval=1)
    return {"model": model, "optim": opt, "scaler": scaler, "step": 0}


def train_step(state: dict[str, Any], seed: int) -> float:
    model, opt, scaler = state["model"], state["optim"], state["scaler"]
    width = model.layers[0].in_features
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(64, width, device="cuda", generator=g)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return float(loss)


def device_snapshot(state: dict[str, Any]) -> list[torch.Tensor]:
    """Clones on the device, queued on the current stream: the values as of now, no host sync."""
    out = [t.detach().clone() for t in state["model"].state_dict().values()]
    for s in state["optim"].state.values():
        out += [v.detach().clone() for v in s.values() if isinstance(v, torch.Tensor)]
    scaler = state["scaler"]
    if scaler._scale is not None:
        out += [scaler._scale.clone(), scaler._growth_tracker.clone()]
    else:  # a scaler that was loaded into but has not run yet keeps its values on the host
        out += [
            torch.tensor(scaler._init_scale, dtype=torch.float32),
            torch.tensor(scaler._init_growth_tracker, dtype=torch.int32),
        ]
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y.to(x.device)) for x, y in zip(a, b))


def sleep_cycles(seconds: float) -> int:
    """Cycles of ``torch.cuda._sleep`` that keep the GPU busy for about ``seconds``."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(10_000_000)
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / 10_000_000
    return int(seconds / max(per, 1e-12))


@contextlib.contextmanager
def no_step_hook() -> Iterator[None]:
    """Control: the optimizer step pre-hook of overlap mode does nothing."""
    real = overlap.PendingCopies.hold_step
    overlap.PendingCopies.hold_step = lambda self: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        overlap.PendingCopies.hold_step = real  # type: ignore[method-assign]


@contextlib.contextmanager
def no_stream_wait() -> Iterator[None]:
    """Control: the side stream does not wait for the work queued on the current stream."""
    real_ws, real_we = torch.cuda.Stream.wait_stream, torch.cuda.Stream.wait_event
    sides = set(map(id, staging._streams().values()))

    def wait_stream(self: Any, other: Any) -> None:
        if id(self) not in sides:
            real_ws(self, other)

    def wait_event(self: Any, event: Any) -> None:
        if id(self) not in sides:
            real_we(self, event)

    torch.cuda.Stream.wait_stream = wait_stream  # type: ignore[method-assign]
    torch.cuda.Stream.wait_event = wait_event  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.cuda.Stream.wait_stream = real_ws  # type: ignore[method-assign]
        torch.cuda.Stream.wait_event = real_we  # type: ignore[method-assign]


def race_probe(scratch: Path, cycles: int, *, overlap_mode: bool, writer: str = "thread",
               control: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
               width: int = 2048, layers: int = 24) -> dict[str, Any]:  # fmt: skip
    """Queue a long sleep, then changes to parameters, buffers and the scaler; save; step at
    once; the checkpoint must equal the state queued before the call, bit for bit."""
    state = build(width, layers)
    for i in range(2):
        train_step(state, i)
    path = scratch / f"race-{overlap_mode}-{writer}-{control.__name__ if control else 'real'}"
    # warm-up: the staging buffers, the writer, the layout are made outside the measured call
    stashpoint.async_save(state, scratch / "race-warm", overlap=overlap_mode, writer=writer, overwrite=True).wait()
    model, opt, scaler = state["model"], state["optim"], state["scaler"]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)  # the GPU is busy for a while: everything below waits behind it
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
        for b in model.buffers():
            if b.is_floating_point():
                b.add_(3.0)
        scaler.update(new_scale=torch.full((), 1024.0, device="cuda"))
    want = device_snapshot(state)
    ctx = control() if control is not None else contextlib.nullcontext()
    with ctx:
        t0 = time.perf_counter()
        h = stashpoint.async_save(state, path, overlap=overlap_mode, writer=writer)
        blocking = time.perf_counter() - t0
        opt.step()  # at once: must not change what the checkpoint holds
        with torch.no_grad():
            for b in model.buffers():
                if b.is_floating_point():
                    b.add_(100.0)
            scaler._scale.fill_(7.0)
        stats = h.wait()
    fresh = build(width, layers, seed=1)
    stashpoint.load(fresh, path)
    got = device_snapshot(fresh)
    for q in (path, scratch / "race-warm"):
        shutil.rmtree(q, ignore_errors=True)
    return {
        "blocking_s": blocking,
        "equal": same(want, got),
        "durable_s": stats.total_s,
        "staging_pinned": stats.staging_pinned,
        "state_gb": sum(t.numel() * t.element_size() for t in want) / 1e9,
    }


def load_ordering(scratch: Path, cycles: int) -> bool:
    """A load is ordered after the kernels queued on its targets and before those queued after."""
    w = torch.randn(4096, 4096, device="cuda")
    stashpoint.save({"w": w}, scratch / "order")
    target = torch.zeros_like(w)
    torch.cuda._sleep(cycles)
    target.fill_(7.0)  # queued before the load: must be overwritten by it
    stashpoint.load({"w": target}, scratch / "order")
    after = target * 2  # queued after the load returns: must see the loaded values
    return bool(torch.equal(target, w) and torch.equal(after, w * 2))


def fresh_optimizer_resume(scratch: Path, width: int = 1024, layers: int = 8) -> dict[str, Any]:
    """Train, save, keep training (the reference); a fresh model and optimizer load and continue."""
    state = build(width, layers)
    for i in range(3):
        train_step(state, i)
    stashpoint.async_save(state, scratch / "resume", overlap=True).wait()
    ref = [train_step(state, i) for i in range(3, 6)]
    fresh = build(width, layers, seed=7)  # a fresh optimizer: no state until the load
    stashpoint.load(fresh, scratch / "resume")
    got = [train_step(fresh, i) for i in range(3, 6)]
    return {"equal": ref == got, "reference": ref, "resumed": got}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fsdp2_resume(scratch: Path, width: int = 1024, layers: int = 4) -> dict[str, Any]:
    """FSDP2 (one rank, NCCL for training, stashpoint's own gloo group): a fresh sharded model and
    optimizer load and continue with the same losses."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", torch.cuda.current_device()))
    try:

        def make(seed: int) -> dict[str, Any]:
            torch.manual_seed(seed)
            model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).cuda()
            for layer in model:
                fully_shard(layer)
            fully_shard(model)
            return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-3)}

        def step(st: dict[str, Any], i: int) -> float:
            g = torch.Generator(device="cuda").manual_seed(i)
            loss = st["model"](torch.randn(32, width, device="cuda", generator=g)).pow(2).mean()
            loss.backward()
            st["optim"].step()
            st["optim"].zero_grad()
            return float(loss)

        state = make(0)
        for i in range(3):
            step(state, i)
        stashpoint.async_save(state, scratch / "fsdp2").wait()
        ref = [step(state, i) for i in range(3, 6)]
        fresh = make(5)
        stashpoint.load(fresh, scratch / "fsdp2")
        got = [step(fresh, i) for i in range(3, 6)]
        dtensor = type(next(fresh["model"].parameters())).__name__
        return {"equal": ref == got, "reference": ref, "resumed": got, "param_type": dtensor}
    finally:
        dist.destroy_process_group()


def pinned_host_bytes() -> dict[str, int] | None:
    """torch's caching host allocator: pinned bytes held now, and at the peak since the reset."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return None
    s = stats()
    return {k: int(s.get(k, 0)) for k in ("allocated_bytes.current", "allocated_bytes.peak", "active_bytes.current")}


def pinned_load(scratch: Path, size_gb: float) -> dict[str, Any]:
    """Pinned host memory held before and after loading ``size_gb`` into CUDA tensors."""
    n = max(1, round(size_gb * 1e9 / (4096 * 4096 * 4)))
    state = {f"w{i}": torch.randn(4096, 4096, device="cuda") for i in range(n)}
    stashpoint.save(state, scratch / "big")
    target = {k: torch.empty_like(v) for k, v in state.items()}
    reset = getattr(torch.cuda, "reset_peak_host_memory_stats", None)
    if reset is not None:
        reset()
    before = pinned_host_bytes()
    times = []
    for _ in range(2):  # the second reads from the page cache, as a restart on the same node does
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        stashpoint.load(target, scratch / "big")
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    after = pinned_host_bytes()
    ok = all(torch.equal(target[k], state[k]) for k in state)
    shutil.rmtree(scratch / "big", ignore_errors=True)
    nbytes = n * 4096 * 4096 * 4
    host = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=True)
    dev = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    dev.copy_(host)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    h2d = nbytes / (time.perf_counter() - t0) / 1e9
    return {
        "state_gb": nbytes / 1e9,
        "load_s": times,
        "load_gbps": [nbytes / t / 1e9 for t in times],
        "raw_pinned_h2d_gbps": h2d,
        "pinned_before_bytes": before,
        "pinned_after_bytes": after,
        "equal": ok,
    }


def small_tensors(scratch: Path, count: int = 10_000) -> dict[str, Any]:
    """``count`` small parameters with AdamW: the call's blocking time, both modes."""
    params = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(256, device="cuda")) for _ in range(count))
    opt = torch.optim.AdamW(params.parameters(), lr=1e-3, foreach=True)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    state = {"model": params, "optim": opt}
    out: dict[str, Any] = {"tensors": 3 * count}
    for mode in (True, False):
        stashpoint.async_save(state, scratch / f"small-warm-{mode}", overlap=mode).wait()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        h = stashpoint.async_save(state, scratch / f"small-{mode}", overlap=mode)
        out[f"blocking_s_overlap_{mode}"] = time.perf_counter() - t0
        opt.step()
        h.wait()
    dst = [torch.empty(p.shape, pin_memory=True) for p in params]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for d, p in zip(dst, params):
        d.copy_(p, non_blocking=True)
    torch.cuda.synchronize()
    out["per_tensor_copy_loop_s_params_only"] = time.perf_counter() - t0
    return out


def dcp_pinned_async(state: dict[str, Any], scratch: Path) -> dict[str, Any]:
    """``dcp.async_save`` with ``DefaultStager(pinned, async staging, non-blocking copies)``: call
    time, staging time and time until durable, second save (the first allocates)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import state_dict_saver
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    out: dict[str, Any] = {}
    stager = None
    try:  # whatever fails here, the group goes: the FSDP2 probe after this one makes its own
        dist.init_process_group("gloo", rank=0, world_size=1)
        stager = DefaultStager(StagingOptions(True, False, True, True))
        msd, osd = get_state_dict(state["model"], state["optim"])
        # CUDA tensors alone (AdamW's CPU step counts left out): torch 2.11's DefaultStager failed
        # to deep-copy this state on an H200 (KeyError: <class 'type'> in _reconstruct)
        sd = {
            "model": {k: v for k, v in msd.items() if v.is_cuda},
            "optim": {f"{k}.{n}": t for k, v in osd["state"].items() for n, t in v.items() if t.is_cuda},
        }
        for i in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            res = state_dict_saver.async_save(sd, checkpoint_id=str(scratch / f"dcp{i}"), async_stager=stager)
            call = time.perf_counter() - t0
            staged = getattr(res, "staging_completion", None)
            if staged is not None:
                staged.result()
            t_staged = time.perf_counter() - t0
            getattr(res, "upload_completion", res).result()
            out = {"blocking_s": call, "staged_s": t_staged, "durable_s": time.perf_counter() - t0}
            shutil.rmtree(scratch / f"dcp{i}", ignore_errors=True)
    finally:
        if stager is not None:
            stager.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return out


def cuda_pair_check() -> bool:
    """The gathered-copy path against the device: many small CUDA tensors into one staging buffer."""
    srcs = [torch.randn(n, device="cuda").to(dt) for n, dt in [(3, torch.float32), (17, torch.bfloat16),
            (5, torch.int64), (9, torch.bool)] * 50]  # fmt: skip
    host = torch.empty(sum(-(-s.numel() * s.element_size() // 64) * 64 for s in srcs), dtype=torch.uint8)
    views, off = [], 0
    for s in srcs:
        n = s.numel() * s.element_size()
        views.append(host[off : off + n].view(s.dtype))
        off += -(-n // 64) * 64
    for _, e in cudacopy.launch_cuda(list(zip(srcs, views))):
        e.synchronize()
    return all(torch.equal(v, s.cpu()) for v, s in zip(views, srcs))
