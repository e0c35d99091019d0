"""The CUDA path on one GPU, in under three minutes: correctness, blocking time, staging bandwidth.

    python -m benchmarks.gpu_check [--size-gb 4] [--out gpu_check.json]
    python -m benchmarks.gpu_check --device cpu --size-gb 0.05    # smoke run without a GPU

Checks, each printed as PASS/FAIL (exit code 1 on any FAIL):

1. a model + AdamW state on the GPU saved with ``async_save`` loads back bitwise equal, into
   GPU tensors;
2. the staging buffers are pinned host memory (on CUDA) and reused by the next save;
3. ordering: the GPU kernels queued before ``async_save`` are in the checkpoint, and an in-place
   update launched right after it returns is not (the side stream waits on the current one);
4. ``overlap=True`` (when this version has it): the checkpoint equals the state at the call
   while a training step runs right after it.

Measures (hot: after one warm-up save): blocking time of ``async_save`` and of
``async_save(overlap=True)``, against ``torch.save`` of the same state (device-to-host copy +
write + fsync); staging bandwidth (bytes / staging time) against a plain ``.cpu()`` copy and a
pinned ``copy_`` of the same bytes; load time into GPU tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import stashpoint


def build(size_gb: float, device: torch.device, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A stack of linear layers whose weights + AdamW moments are about ``size_gb``."""
    torch.manual_seed(seed)
    width = 4096 if size_gb >= 1 else 1024
    per_layer = width * width * 4 * 3  # fp32 weights and two moments
    layers = max(1, round(size_gb * 1e9 / per_layer))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step(model, opt, device)
    return model, opt


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> None:
    width = model[0].in_features  # type: ignore[index]
    x = torch.randn(8, width, device=device)
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().cpu().clone() for p in model.parameters()]
    for s in opt.state.values():
        out += [v.detach().cpu().clone() for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fsync_tree(path: Path) -> None:
    for p in [path] if path.is_file() else path.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=4.0)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke run")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: nothing to check (use --device cpu for a smoke run)")
        return 0
    device = torch.device(args.device)
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="stashpoint-gpu-check-"))
    scratch.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    checks: dict[str, bool] = {}
    t_all = time.perf_counter()
    try:
        model, opt = build(args.size_gb, device)
        state = {"model": model, "optim": opt, "step": 1}
        nbytes = sum(t.numel() * t.element_size() for t in snapshot(model, opt))
        results["state_gb"] = nbytes / 1e9
        print(f"state: {nbytes / 1e9:.2f} GB on {results['device']}")

        # 1 + 2: round trip, pinned and reused staging (warm-up save first)
        stashpoint.save(state, scratch / "warm")
        before = snapshot(model, opt)
        h = stashpoint.async_save(state, scratch / "ck")
        stats = h.wait()
        model2, opt2 = build(args.size_gb, device, seed=1)
        t0 = time.perf_counter()
        stashpoint.load({"model": model2, "optim": opt2, "step": 0}, scratch / "ck")
        sync(device)
        results["load_s"] = time.perf_counter() - t0
        on_device = all(p.device == device for p in model2.parameters())
        checks["round trip is bitwise equal, into tensors on the device"] = on_device and same(
            before, snapshot(model2, opt2)
        )
        from stashpoint._save import engine as _save

        pool = _save.get_engine().pool._free
        if device.type == "cuda":
            checks["staging buffers are pinned host memory"] = bool(pool) and all(b.buffer.is_pinned() for b in pool)
        results["blocking_s"] = stats.blocking_s
        results["staging_gbps"] = nbytes / stats.staging_s / 1e9 if stats.staging_s else None
        results["durable_s"] = stats.total_s

        # 3: ordering on the streams
        for p in model.parameters():
            p.data.mul_(1.0001)  # queued before the call: must be in the checkpoint
        want = snapshot(model, opt)
        h = stashpoint.async_save(state, scratch / "ck3")
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # launched right after the call: must not be
        h.wait()
        model3, opt3 = build(args.size_gb, device, seed=2)
        stashpoint.load({"model": model3, "optim": opt3, "step": 0}, scratch / "ck3")
        checks["the checkpoint holds the kernels queued before the call, not those after"] = same(
            want, snapshot(model3, opt3)
        )

        # 4: overlap mode, if this version has it
        try:
            want = snapshot(model, opt)
            h = stashpoint.async_save(state, scratch / "ck4", overlap=True)  # type: ignore[call-arg]
        except TypeError:
            results["overlap"] = "not available in this version"
        else:
            step(model, opt, device)  # the optimizer step waits for the copies it would change
            ostats = h.wait()
            results["overlap_blocking_s"] = ostats.blocking_s
            model4, opt4 = build(args.size_gb, device, seed=3)
            stashpoint.load({"model": model4, "optim": opt4, "step": 0}, scratch / "ck4")
            checks["overlap=True: the checkpoint equals the state at the call"] = same(want, snapshot(model4, opt4))

        # the peers' way: torch.save of the same state (device-to-host copy, write, fsync)
        sync(device)
        t0 = time.perf_counter()
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, scratch / "torch.pt")
        fsync_tree(scratch / "torch.pt")
        results["torch_save_fsync_s"] = time.perf_counter() - t0
        # raw device-to-host copy bandwidths of the same bytes
        tensors = [p.detach() for p in model.parameters()]
        pbytes = sum(t.numel() * t.element_size() for t in tensors)
        if device.type == "cuda":
            sync(device)
            t0 = time.perf_counter()
            _ = [t.cpu() for t in tensors]
            sync(device)
            results["plain_cpu_copy_gbps"] = pbytes / (time.perf_counter() - t0) / 1e9
            dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            sync(device)
            t0 = time.perf_counter()
            for d, t in zip(dst, tensors):
                d.copy_(t, non_blocking=True)
            sync(device)
            results["pinned_copy_gbps"] = pbytes / (time.perf_counter() - t0) / 1e9
        results["blocking_vs_torch_save"] = results["torch_save_fsync_s"] / results["blocking_s"]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results["checks"] = checks
    results["seconds"] = time.perf_counter() - t_all
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    for k, v in results.items():
        if k != "checks":
            print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0 if checks and all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
