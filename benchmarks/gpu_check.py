"""The CUDA path on one GPU, in under seven minutes: correctness, races, memory, figures.

    python -m benchmarks.gpu_check [--size-gb 4] [--out gpu_check.json]
    python -m benchmarks.gpu_check --device cpu --size-gb 0.05    # smoke run without a GPU

Checks, each printed as PASS/FAIL (exit code 1 on any FAIL):

1. the repository's CUDA tests (``pytest`` on the files that hold them);
2. a model + AdamW state on the GPU saved with ``async_save`` loads back bitwise equal, into
   GPU tensors; the staging buffers are pinned (``SaveStats.staging_pinned``) and the same
   buffers serve three saves;
3. ordering: kernels queued before ``async_save`` are in the checkpoint, an in-place update
   launched right after it returns is not; ``overlap=True`` equals the state at the call;
4. race probes (``gpu_probes.race_probe``): a long ``torch.cuda._sleep`` queued, then changes
   to parameters, buffers and the GradScaler, then ``async_save``, then ``step()`` at once;
   the checkpoint must equal the state queued before the call, and with ``overlap=True`` the
   call must return in under 0.2 s (no host sync: GradScaler included). Overlap mode with the
   writer thread and the writer process, and ``overlap=False``. **Controls that must fail**:
   the step hook disabled, and the side stream's wait on the current stream removed;
5. a load is ordered after the kernels queued on its targets; a fresh model and optimizer load
   and continue with the same losses, on one GPU and under FSDP2 (NCCL training, stashpoint's
   gloo group); a load of ``--size-gb`` into CUDA tensors holds little pinned host memory;
   small CUDA tensors gathered into one transfer land bit for bit.

Figures (hot: after a warm-up save): blocking time of ``async_save`` (both modes) against
``torch.save`` + fsync and DCP ``async_save`` with its pinned ``DefaultStager``; staging
bandwidth against a plain ``.cpu()`` and a raw pinned ``copy_``; time until durable; load
time; the call's time with 10k small parameters (30k tensors with AdamW's moments).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
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


# every file holding a test marked ``cuda`` (tests/test_gpu_check.py checks the list); their
# other tests run too: on a CUDA build of torch some take other paths (pinned staging)
CUDA_TEST_FILES = [
    "tests/test_cudapath.py", "tests/test_scaler.py", "tests/test_pinring.py", "tests/test_overlap.py",
    "tests/test_writer_process.py", "tests/test_roundtrip.py", "tests/test_cuda_order.py",
]  # fmt: skip
TESTS_TIMEOUT_S = 240


def run_cuda_tests(log: str | None) -> dict[str, Any]:
    """The repository's CUDA tests and their files' other tests; the whole output goes to
    ``log`` (also when they run past the time given them), the failures' names into the result."""
    root = Path(__file__).resolve().parent.parent
    files = [f for f in CUDA_TEST_FILES if (root / f).exists()]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "-n", "8", *files]
    t0 = time.perf_counter()
    # a session of its own: a timeout stops pytest's workers too (they would hold the GPU while
    # the next section measures)
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        text, _ = proc.communicate(timeout=TESTS_TIMEOUT_S)
        rc = proc.returncode
    except subprocess.TimeoutExpired:  # what ran is kept: the log says where it stopped
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        rc = -1
        text += f"\n[gpu_check] the tests ran past {TESTS_TIMEOUT_S} s and were stopped"
    if log:
        Path(log).write_text(text)
    failed = [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))]
    print("\n".join(failed) or text[-1500:])
    return {"rc": rc, "seconds": time.perf_counter() - t0, "failed": failed, "tail": text[-1500:]}


class Report:
    """Results and checks, written to ``--out`` after every section (a run cut short keeps them)."""

    def __init__(self, out: str | None) -> None:
        self.out = out
        self.results: dict[str, Any] = {}
        self.checks: dict[str, bool] = {}
        self.errors: dict[str, str] = {}

    def section(self, name: str, fn: Any) -> Any:
        t0 = time.perf_counter()
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            return fn()
        except Exception:
            self.errors[name] = traceback.format_exc()[-2000:]
            self.checks[f"{name}: ran without an error"] = False
            print(self.errors[name], flush=True)
            return None
        finally:
            self.results.setdefault("section_s", {})[name] = time.perf_counter() - t0
            self.write()

    def write(self) -> None:
        if self.out:
            doc = {**self.results, "checks": self.checks, "errors": self.errors}
            Path(self.out).write_text(json.dumps(doc, indent=2, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=4.0)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke run")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--load-gb", type=float, default=4.0, help="size of the pinned-memory load probe")
    ap.add_argument("--skip-tests", action="store_true", help="do not run the repository's CUDA tests")
    ap.add_argument("--tests-log", default=None, help="write the CUDA tests' whole output here")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: nothing to check (use --device cpu for a smoke run)")
        return 0
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="stashpoint-gpu-check-"))
    scratch.mkdir(parents=True, exist_ok=True)
    rep = Report(args.out)
    results, checks = rep.results, rep.checks
    results["device"] = torch.cuda.get_device_name(device) if cuda else "cpu"
    results["torch"] = torch.__version__
    t_all = time.perf_counter()
    try:
        if cuda and not args.skip_tests:
            tests = rep.section("cuda tests", lambda: run_cuda_tests(args.tests_log))
            if tests is not None:
                results["cuda_tests"] = tests
                checks["the repository's CUDA tests pass"] = tests["rc"] == 0
        rep.section("main state", lambda: _main_state(args, device, scratch, results, checks))
        if cuda:
            _probes(rep, scratch, args.load_gb)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results["seconds"] = time.perf_counter() - t_all
    rep.write()
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    for k, v in results.items():
        if k not in ("cuda_tests",):
            print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")
    return 0 if checks and all(checks.values()) else 1


def _main_state(
    args: Any, device: torch.device, scratch: Path, results: dict[str, Any], checks: dict[str, bool]
) -> None:
    model, opt = build(args.size_gb, device)
    state = {"model": model, "optim": opt, "step": 1}
    nbytes = sum(t.numel() * t.element_size() for t in snapshot(model, opt))
    results["state_gb"] = nbytes / 1e9
    print(f"state: {nbytes / 1e9:.2f} GB on {results['device']}")
    cuda = device.type == "cuda"

    # round trip, pinned and reused staging (warm-up save first)
    stashpoint.save(state, scratch / "warm")
    before = snapshot(model, opt)
    h = stashpoint.async_save(state, scratch / "ck")
    stats = h.wait()
    model2, opt2 = build(args.size_gb, device, seed=1)
    t0 = time.perf_counter()
    stashpoint.load({"model": model2, "optim": opt2, "step": 0}, scratch / "ck")
    sync(device)
    results["load_s"] = time.perf_counter() - t0
    on_device = all(p.device.type == device.type for p in model2.parameters())
    checks["round trip is bitwise equal, into tensors on the device"] = on_device and same(
        before, snapshot(model2, opt2)
    )
    del model2, opt2
    gone(scratch / "warm", scratch / "ck")
    from stashpoint._save import engine as _save

    eng = _save.get_engine()
    if cuda:
        checks["staging buffers are pinned host memory (SaveStats.staging_pinned)"] = bool(
            stats.staging_pinned and eng.pool._free and all(b.pinned and b.buffer.is_pinned() for b in eng.pool._free)
        )
    results["blocking_s"] = stats.blocking_s
    results["staging_gbps"] = nbytes / stats.staging_s / 1e9 if stats.staging_s else None
    results["durable_s"] = stats.total_s
    ptrs, allocations = [], eng.pool.allocations
    for i in range(3):
        st = stashpoint.async_save(state, scratch / f"reuse{i}").wait()
        gone(scratch / f"reuse{i}")  # the disk holds a few states at most
        ptrs += [b.buffer.data_ptr() for b in eng.pool._free]
        results.setdefault("blocking_s_hot", []).append(st.blocking_s)
    checks["the same staging buffer serves three saves"] = len(set(ptrs)) == 1 and eng.pool.allocations == allocations

    # ordering on the streams
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
    del model3, opt3
    gone(scratch / "ck3")

    # overlap mode
    want = snapshot(model, opt)
    stashpoint.async_save(state, scratch / "ck4w", overlap=True).wait()
    h = stashpoint.async_save(state, scratch / "ck4", overlap=True)
    step(model, opt, device)  # the optimizer step waits for the copies it would change
    ostats = h.wait()
    results["overlap_blocking_s"] = ostats.blocking_s
    results["overlap_durable_s"] = ostats.total_s
    model4, opt4 = build(args.size_gb, device, seed=3)
    stashpoint.load({"model": model4, "optim": opt4, "step": 0}, scratch / "ck4")
    checks["overlap=True: the checkpoint equals the state at the call"] = same(want, snapshot(model4, opt4))
    del model4, opt4
    gone(scratch / "ck4", scratch / "ck4w")

    # the peers' way: torch.save of the same state (device-to-host copy, write, fsync)
    sync(device)
    t0 = time.perf_counter()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, scratch / "torch.pt")
    fsync_tree(scratch / "torch.pt")
    results["torch_save_fsync_s"] = time.perf_counter() - t0
    results["blocking_vs_torch_save"] = results["torch_save_fsync_s"] / results["blocking_s"]
    gone(scratch / "torch.pt")
    if cuda:
        _raw_copies(model, results)
        from benchmarks import gpu_probes

        dcp = gpu_probes.dcp_pinned_async({"model": model, "optim": opt}, scratch)
        results["dcp_async_pinned"] = dcp
        results["blocking_vs_dcp_async_pinned"] = dcp["blocking_s"] / results["blocking_s"]
        results["overlap_blocking_vs_dcp_async_pinned"] = dcp["blocking_s"] / results["overlap_blocking_s"]


def gone(*paths: Path) -> None:
    """Delete checkpoints once checked: a few states of several GB would fill a small disk."""
    for p in paths:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _raw_copies(model: torch.nn.Module, results: dict[str, Any]) -> None:
    """Raw device-to-host bandwidths of the parameters' bytes: ``.cpu()`` and a pinned ``copy_``."""
    tensors = [p.detach() for p in model.parameters()]
    pbytes = sum(t.numel() * t.element_size() for t in tensors)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _ = [t.cpu() for t in tensors]
    torch.cuda.synchronize()
    results["plain_cpu_copy_gbps"] = pbytes / (time.perf_counter() - t0) / 1e9
    dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for _ in range(2):  # the second is the figure (the first touches the pages)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for d, t in zip(dst, tensors):
            d.copy_(t, non_blocking=True)
        torch.cuda.synchronize()
        results["pinned_copy_gbps"] = pbytes / (time.perf_counter() - t0) / 1e9
    if results.get("staging_gbps"):
        results["staging_vs_pinned_copy"] = results["staging_gbps"] / results["pinned_copy_gbps"]


def _probes(rep: Report, scratch: Path, size_gb: float) -> None:
    from benchmarks import gpu_probes as gp

    results, checks = rep.results, rep.checks
    cycles = gp.sleep_cycles(0.5)
    results["sleep_cycles_0.5s"] = cycles
    probes = {
        "overlap=True, writer thread": dict(overlap_mode=True),
        "overlap=True, writer process": dict(overlap_mode=True, writer="process"),
        "overlap=False": dict(overlap_mode=False),
    }
    for name, kw in probes.items():
        r = rep.section(f"race {name}", lambda kw=kw: gp.race_probe(scratch, cycles, **kw))
        if r is None:
            continue
        results[f"race {name}"] = r
        checks[f"race {name}: the checkpoint is the state queued before the call"] = r["equal"]
        if kw["overlap_mode"]:
            checks[f"race {name}: the call returns in under 0.2 s with the GPU busy"] = r["blocking_s"] < 0.2
    controls = {
        "step hook disabled, overlap=True": dict(overlap_mode=True, control=gp.no_step_hook),
        "side-stream wait removed, overlap=True": dict(overlap_mode=True, control=gp.no_stream_wait),
        "side-stream wait removed, overlap=False": dict(overlap_mode=False, control=gp.no_stream_wait),
    }
    for name, kw in controls.items():
        r = rep.section(f"control {name}", lambda kw=kw: gp.race_probe(scratch, cycles, **kw))
        if r is not None:
            results[f"control {name}"] = r
            checks[f"control ({name}) is caught: the probe fails"] = not r["equal"]
    ok = rep.section("load ordering", lambda: gp.load_ordering(scratch, cycles))
    if ok is not None:
        checks["a load is ordered after the kernels queued on its targets"] = ok
    r = rep.section("fresh optimizer, one GPU", lambda: gp.fresh_optimizer_resume(scratch))
    if r is not None:
        results["resume one GPU"] = r
        checks["a fresh model and optimizer load and continue with the same losses (one GPU)"] = r["equal"]
    ok = rep.section("gathered copies", gp.cuda_pair_check)
    if ok is not None:
        checks["small CUDA tensors gathered into one transfer land bit for bit"] = ok
    r = rep.section("small tensors", lambda: gp.small_tensors(scratch))
    if r is not None:
        results["10k small parameters"] = r
    r = rep.section("pinned load", lambda: gp.pinned_load(scratch, size_gb))
    if r is not None:
        results["pinned load"] = r
        checks["a load into CUDA tensors lands bit for bit"] = r["equal"]
        if r["pinned_before_bytes"] is not None:
            grew = r["pinned_after_bytes"]["allocated_bytes.peak"] - r["pinned_before_bytes"]["allocated_bytes.current"]
            checks["a load holds at most 256 MiB of pinned host memory at its peak"] = grew <= 256 << 20

    # last: it starts (and ends) a process group, which the probes above do without
    r = rep.section("fresh optimizer, FSDP2", lambda: gp.fsdp2_resume(scratch))
    if r is not None:
        results["resume FSDP2"] = r
        checks["FSDP2 (NCCL): a fresh model and optimizer load and continue with the same losses"] = r["equal"]


if __name__ == "__main__":
    sys.exit(main())
