"""Core benchmark: stashpoint against torch.save and DCP on one realistic training state.

Builds a GPT-style model's fp32 weights plus a real AdamW state after one step (weights and two
moments, several hundred tensors) and measures, side by side in one run:

* saves: ``torch.save`` + fsync, ``dcp.save`` (sync), DCP ``async_save`` (default thread
  executor), ``stashpoint.save``, ``stashpoint.async_save`` and ``async_save(overlap=True)`` —
  training stall ("blocking"), time until durable, throughput and peak extra host memory (with
  overlap also the time until every tensor was copied, which a ``step()`` coming sooner waits for);
* the floor: one ``copy_`` of the whole state into already-touched, reused host buffers;
* loads into the already-allocated live state: ``torch.load(mmap=True)`` + copy, ``dcp.load``
  (+ ``set_state_dict``) and ``stashpoint.load``, each verified against the saved values.

Every method runs in its own subprocess so peak RSS is clean and no allocator state is shared.
See ``/work/shared/ANCHORS.md`` for the page-cache regimes: ``--regime cold`` waits 10 s after
deleting the previous checkpoint before each measured save.

    python -m benchmarks.bench_core --size-gb 2.5 --repeats 3 --regime cold \\
        --out benchmarks/out/core.json --markdown benchmarks/out/core.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SAVE_METHODS = ("torch_save", "dcp_save", "dcp_async", "stashpoint_save", "stashpoint_async", "stashpoint_overlap")
FLOOR = "memcpy_floor"
ALL_WORKERS = (FLOOR, *SAVE_METHODS)
# Loads run in the worker of the matching sync save, on its last checkpoint.
LOAD_OF = {"torch_save": "torch_load_mmap", "dcp_save": "dcp_load", "stashpoint_save": "stashpoint_load"}
LABELS = {
    "torch_save": "torch.save + fsync",
    "dcp_save": "dcp.save (sync)",
    "dcp_async": "DCP async_save (thread)",
    "stashpoint_save": "stashpoint.save",
    "stashpoint_async": "stashpoint.async_save",
    "stashpoint_overlap": "stashpoint.async_save(overlap=True)",
    "torch_load_mmap": "torch.load(mmap=True) + copy_",
    "dcp_load": "dcp.load + set_state_dict",
    "stashpoint_load": "stashpoint.load",
}
COLD_SLEEP_S = 10.0
GB = 1e9


def log(msg: str) -> None:
    print(f"[bench_core {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# The state
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """A GPT-2-style decoder: untied embeddings and head, 12 parameter tensors per block."""

    layers: int
    width: int
    vocab: int
    context: int

    @property
    def num_params(self) -> int:
        d = self.width
        return self.layers * (12 * d * d + 13 * d) + (2 * self.vocab + self.context + 2) * d

    @property
    def num_param_tensors(self) -> int:
        return 12 * self.layers + 5

    @property
    def state_bytes(self) -> int:
        # fp32 weights + exp_avg + exp_avg_sq, plus AdamW's scalar fp32 `step` per parameter.
        return 12 * self.num_params + 4 * self.num_param_tensors


def choose_shape(size_gb: float) -> Shape:
    """Layers and width (a multiple of 64) whose weights + AdamW state come closest to ``size_gb``.

    Among shapes within 3% of the target, the one with width/layers closest to 48 (GPT-like
    proportions) wins.
    """
    target = size_gb * GB
    vocab = int(min(50304, max(4096, round(32000 * math.sqrt(size_gb / 2.5) / 64) * 64)))
    context = 2048 if size_gb >= 1 else 1024
    best: tuple[tuple[bool, float], Shape] | None = None
    for layers in range(2, 97):
        a = 12 * 12 * layers
        b = 12 * (13 * layers + 2 * vocab + context + 2)
        d = (-b + math.sqrt(b * b + 4 * a * target)) / (2 * a)
        for width in {max(64, math.floor(d / 64) * 64), max(64, math.ceil(d / 64) * 64)}:
            shape = Shape(layers, width, vocab, context)
            err = abs(shape.state_bytes - target) / target
            close = err <= 0.03
            key = (not close, abs(math.log(width / layers / 48)) if close else err)
            if best is None or key < best[0]:
                best = (key, shape)
    assert best is not None
    return best[1]


def build_state(shape: Shape, seed: int) -> dict[str, Any]:
    """{"model": GPT module, "optim": AdamW after one step, "step": int}, seeded and deterministic."""
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.c_attn = nn.Linear(d, 3 * d)
            self.c_proj = nn.Linear(d, d)

    class MLP(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.c_fc = nn.Linear(d, 4 * d)
            self.c_proj = nn.Linear(4 * d, d)

    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.ln_1 = nn.LayerNorm(d)
            self.attn = Attention(d)
            self.ln_2 = nn.LayerNorm(d)
            self.mlp = MLP(d)

    class GPT(nn.Module):
        def __init__(self, s: Shape) -> None:
            super().__init__()
            self.wte = nn.Embedding(s.vocab, s.width)
            self.wpe = nn.Embedding(s.context, s.width)
            self.h = nn.ModuleList(Block(s.width) for _ in range(s.layers))
            self.ln_f = nn.LayerNorm(s.width)
            self.lm_head = nn.Linear(s.width, s.vocab, bias=False)

    with torch.device("meta"):
        model = GPT(shape)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    for p in model.parameters():
        p.grad = torch.empty_like(p).normal_(0.0, 1e-3, generator=g)
    optim.step()
    model.zero_grad(set_to_none=True)
    return {"model": model, "optim": optim, "step": 1000}


def live_tensors(state: dict[str, Any]) -> list[Any]:
    """Every tensor of the live state, in a fixed order (re-read each time: loads may replace them)."""
    model, optim = state["model"], state["optim"]
    out = list(model.parameters())
    for group in optim.param_groups:
        for p in group["params"]:
            st = optim.state[p]
            out.extend(st[k] for k in sorted(st))
    return out


def fingerprint(state: dict[str, Any]) -> list[Any]:
    """~64 strided samples per tensor plus the step, to check that a load restored the saved values."""
    fp: list[Any] = []
    for t in live_tensors(state):
        flat = t.detach().reshape(-1)
        fp.append(flat[:: max(1, flat.numel() // 64)].clone())
    fp.append(state["step"])
    return fp


def same_fingerprint(a: list[Any], b: list[Any]) -> bool:
    import torch

    if len(a) != len(b):
        return False
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b, strict=True))


def scramble(state: dict[str, Any]) -> None:
    """Zero the live state so a load that skips anything is caught by the fingerprint check."""
    import torch

    with torch.no_grad():
        for t in live_tensors(state):
            t.zero_()
    state["step"] = -1


# --------------------------------------------------------------------------------------------
# Memory and files
# --------------------------------------------------------------------------------------------


class RssMonitor:
    """Samples this process's RSS every ``interval`` s; also reads the kernel's VmHWM if it can reset it."""

    def __init__(self, interval: float = 0.01) -> None:
        import psutil

        self._proc = psutil.Process()
        self._interval = interval
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.peak = self.rss()
        self._hwm_ok = self._reset_hwm()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def rss(self) -> int:
        return int(self._proc.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.is_set():
            r = self.rss()
            with self._lock:
                self.peak = max(self.peak, r)
            self._stop.wait(self._interval)

    @staticmethod
    def _reset_hwm() -> bool:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            return True
        except OSError:
            return False

    @staticmethod
    def _hwm() -> int | None:
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return None

    def reset(self) -> None:
        with self._lock:
            self.peak = self.rss()
        self._hwm_ok = self._reset_hwm()

    def peaks(self) -> tuple[int, int | None]:
        """(sampled peak, kernel high-water mark since the last reset, or None)."""
        r = self.rss()
        with self._lock:
            self.peak = max(self.peak, r)
            peak = self.peak
        return peak, (self._hwm() if self._hwm_ok else None)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def evict_cache(path: Path) -> None:
    """Drop this checkpoint's (clean, fsynced) pages from the page cache; touches no other file."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------------------------
# Savers and loaders. A saver takes a fresh path and returns its figures; blocking_s is the time
# training is stalled (state-dict construction included), durable_s the time until the
# checkpoint is durable on storage.
# --------------------------------------------------------------------------------------------


def make_saver(method: str, state: dict[str, Any], op_timeout: float) -> Any:
    import torch

    model, optim = state["model"], state["optim"]

    if method == "torch_save":

        def save(path: Path) -> dict[str, Any]:
            path.mkdir(parents=True)
            t0 = time.perf_counter()
            sd = {"model": model.state_dict(), "optim": optim.state_dict(), "step": state["step"]}
            with (path / "checkpoint.pt").open("wb") as f:
                torch.save(sd, f)
                f.flush()
                os.fsync(f.fileno())
            t1 = time.perf_counter()
            return {"blocking_s": t1 - t0, "durable_s": t1 - t0}

        return save

    if method in ("dcp_save", "dcp_async"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        def dcp_sd() -> dict[str, Any]:
            msd, osd = get_state_dict(model, optim)
            return {"model": msd, "optim": osd, "step": state["step"]}

        if method == "dcp_save":

            def save(path: Path) -> dict[str, Any]:
                t0 = time.perf_counter()
                sd = dcp_sd()
                t_sd = time.perf_counter()
                dcp.save(sd, checkpoint_id=str(path))
                t1 = time.perf_counter()
                return {"blocking_s": t1 - t0, "durable_s": t1 - t0, "state_dict_s": t_sd - t0}

            return save

        def save(path: Path) -> dict[str, Any]:
            t0 = time.perf_counter()
            sd = dcp_sd()
            t_sd = time.perf_counter()
            fut = dcp.async_save(sd, checkpoint_id=str(path))
            t1 = time.perf_counter()
            # Newer DCP may return an AsyncSaveResponse (staging + upload futures) instead of a Future.
            done = getattr(fut, "upload_completion", fut)
            done.result(timeout=op_timeout)
            t2 = time.perf_counter()
            return {"blocking_s": t1 - t0, "durable_s": t2 - t0, "state_dict_s": t_sd - t0}

        return save

    if method in ("stashpoint_save", "stashpoint_async", "stashpoint_overlap"):
        import stashpoint

        if method == "stashpoint_save":

            def save(path: Path) -> dict[str, Any]:
                t0 = time.perf_counter()
                stats = stashpoint.save(state, str(path))
                t1 = time.perf_counter()
                return {
                    "blocking_s": t1 - t0,
                    "durable_s": t1 - t0,
                    "lib_staging_s": stats.staging_s,
                    "lib_persist_s": stats.persist_s,
                    "lib_bytes_written": stats.bytes_written,
                }

            return save

        overlap = method == "stashpoint_overlap"

        def save(path: Path) -> dict[str, Any]:
            t0 = time.perf_counter()
            handle = stashpoint.async_save(state, str(path), overlap=overlap)
            t1 = time.perf_counter()
            stats = handle.wait(timeout=op_timeout)
            t2 = time.perf_counter()
            return {
                "blocking_s": t1 - t0,
                "durable_s": t2 - t0,
                "lib_blocking_s": handle.blocking_s,
                "lib_staging_s": stats.staging_s,
                "lib_staged_s": stats.staged_s,
                "lib_persist_s": stats.persist_s,
                "lib_bytes_written": stats.bytes_written,
            }

        return save

    raise ValueError(f"unknown save method {method!r}")


def make_loader(name: str, state: dict[str, Any]) -> Any:
    import torch

    model, optim = state["model"], state["optim"]

    if name == "torch_load_mmap":

        def load(path: Path) -> dict[str, Any]:
            t0 = time.perf_counter()
            loaded = torch.load(path / "checkpoint.pt", mmap=True, weights_only=True, map_location="cpu")
            model.load_state_dict(loaded["model"])  # copies into the live parameters
            params = [p for g in optim.param_groups for p in g["params"]]
            with torch.no_grad():
                for idx, saved in loaded["optim"]["state"].items():
                    live = optim.state[params[idx]]
                    for k, v in saved.items():
                        if isinstance(v, torch.Tensor) and isinstance(live.get(k), torch.Tensor):
                            live[k].copy_(v)
                        else:
                            live[k] = v
            for g_live, g_saved in zip(optim.param_groups, loaded["optim"]["param_groups"], strict=True):
                g_live.update({k: v for k, v in g_saved.items() if k != "params"})
            state["step"] = loaded["step"]
            del loaded
            return {"load_s": time.perf_counter() - t0}

        return load

    if name == "dcp_load":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        def load(path: Path) -> dict[str, Any]:
            t0 = time.perf_counter()
            msd, osd = get_state_dict(model, optim)
            sd = {"model": msd, "optim": osd, "step": -1}
            dcp.load(sd, checkpoint_id=str(path))
            t1 = time.perf_counter()
            set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            state["step"] = sd["step"]
            t2 = time.perf_counter()
            return {"load_s": t2 - t0, "set_state_dict_s": t2 - t1}

        return load

    if name == "stashpoint_load":
        import stashpoint

        def load(path: Path) -> dict[str, Any]:
            t0 = time.perf_counter()
            stashpoint.load(state, str(path))
            return {"load_s": time.perf_counter() - t0}

        return load

    raise ValueError(f"unknown load method {name!r}")


# --------------------------------------------------------------------------------------------
# Worker (one method, one process)
# --------------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=r".*assuming the intent is to (save|load) in a single process.*")
    method: str = args.worker
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    shape = choose_shape(args.size_gb)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"method": method, "pid": os.getpid(), "torch_threads": torch.get_num_threads()}

    t0 = time.perf_counter()
    state = build_state(shape, args.seed)
    tensors = live_tensors(state)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    out.update(build_s=time.perf_counter() - t0, state_bytes=nbytes, num_tensors=len(tensors))
    del tensors
    import gc

    gc.collect()
    time.sleep(0.2)
    mon = RssMonitor()
    baseline = mon.rss()
    out["baseline_rss_gb"] = baseline / GB
    log(f"{method}: state built, {nbytes / GB:.3f} GB in {out['num_tensors']} tensors ({out['build_s']:.1f} s)")
    try:
        if method == FLOOR:
            out.update(run_floor(state, args, mon, baseline))
        else:
            out.update(run_saves(method, state, args, mon=mon, baseline=baseline, root=root))
    finally:
        mon.close()
        shutil.rmtree(root, ignore_errors=True)
    return out


def run_floor(state: dict[str, Any], args: argparse.Namespace, mon: RssMonitor, baseline: int) -> dict[str, Any]:
    import torch

    src = live_tensors(state)
    t0 = time.perf_counter()
    bufs = [torch.empty_like(t) for t in src]
    with torch.no_grad():
        for b, t in zip(bufs, src, strict=True):
            b.copy_(t)  # first touch of fresh memory
    first = time.perf_counter() - t0
    times = []
    for _ in range(max(args.repeats, 3)):
        t0 = time.perf_counter()
        with torch.no_grad():
            for b, t in zip(bufs, src, strict=True):
                b.copy_(t)
        times.append(time.perf_counter() - t0)
    peak, hwm = mon.peaks()
    if not all(torch.equal(b, t) for b, t in zip(bufs[:8], src[:8], strict=True)):
        raise RuntimeError("the staging copy does not match its source")
    return {
        "first_touch_copy_s": first,
        "copy_s": times,
        "peak_extra_rss_gb": (peak - baseline) / GB,
        "peak_extra_hwm_gb": None if hwm is None else (hwm - baseline) / GB,
    }


def run_saves(
    method: str, state: dict[str, Any], args: argparse.Namespace, *, mon: RssMonitor, baseline: int, root: Path
) -> dict[str, Any]:
    saver = make_saver(method, state, args.op_timeout)
    reference = fingerprint(state) if method in LOAD_OF else None
    out: dict[str, Any] = {}
    mon.reset()

    path = root / "ckpt-warmup"
    first = saver(path)
    first["ckpt_bytes"] = tree_bytes(path)
    out["first"] = first
    log(f"{method}: warm-up save: blocking {first['blocking_s']:.3f} s, durable {first['durable_s']:.3f} s")
    remove(path)

    records = []
    last: Path | None = None
    for i in range(args.repeats):
        if args.regime == "cold":
            time.sleep(COLD_SLEEP_S)
        path = root / f"ckpt-{i}"
        rec = saver(path)
        rec["ckpt_bytes"] = tree_bytes(path)
        rec["loadavg1"] = os.getloadavg()[0]
        records.append(rec)
        log(
            f"{method}: save {i + 1}/{args.repeats}: blocking {rec['blocking_s']:.3f} s, "
            f"durable {rec['durable_s']:.3f} s"
        )
        if i == args.repeats - 1 and method in LOAD_OF:
            last = path
        else:
            remove(path)
    peak, hwm = mon.peaks()
    out.update(
        saves=records,
        peak_extra_rss_gb=(peak - baseline) / GB,
        peak_extra_hwm_gb=None if hwm is None else (hwm - baseline) / GB,
        retained_rss_gb=(mon.rss() - baseline) / GB,
    )

    if last is not None and reference is not None:
        out["load"] = run_loads(LOAD_OF[method], state, args, mon=mon, reference=reference, path=last)
        remove(last)
    return out


def data_ptrs(state: dict[str, Any]) -> list[int]:
    return [t.data_ptr() for t in live_tensors(state)]


def run_loads(
    name: str, state: dict[str, Any], args: argparse.Namespace, *, mon: RssMonitor, reference: list[Any], path: Path
) -> dict[str, Any]:
    loader = make_loader(name, state)
    ptrs = data_ptrs(state)
    records = []
    for i in range(args.repeats):
        scramble(state)
        if args.load_cache == "evicted":
            evict_cache(path)
        base = mon.rss()
        mon.reset()
        rec = loader(path)
        peak, _ = mon.peaks()
        rec["peak_extra_rss_gb"] = (peak - base) / GB  # includes mapped file pages for mmap loads
        rec["verified"] = same_fingerprint(fingerprint(state), reference)
        rec["in_place"] = data_ptrs(state) == ptrs
        records.append(rec)
        log(f"{name}: load {i + 1}/{args.repeats}: {rec['load_s']:.3f} s, verified={rec['verified']}")
    return {"name": name, "cache": args.load_cache, "loads": records}


# --------------------------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------------------------


def default_scratch_base() -> Path:
    """A temp folder on the same filesystem as the repository (so the disk measured is /work's)."""
    dev = REPO.stat().st_dev
    for cand in (Path("/var/tmp"), Path(tempfile.gettempdir()), Path("/tmp")):
        try:
            if cand.is_dir() and os.access(cand, os.W_OK) and cand.stat().st_dev == dev:
                return cand
        except OSError:
            continue
    return REPO / "benchmarks" / "out" / "scratch"


def worker_timeout(args: argparse.Namespace) -> float:
    if args.timeout:
        return float(args.timeout)
    per_op = 30.0 * args.size_gb + 15.0
    ops = 2 * args.repeats + 2
    sleeps = (args.repeats * COLD_SLEEP_S) if args.regime == "cold" else 0.0
    return 180.0 + 20.0 * args.size_gb + ops * per_op + sleeps


def spawn(method: str, args: argparse.Namespace, scratch: Path, round_no: int) -> dict[str, Any]:
    wdir = scratch / f"{method}-r{round_no}"
    result = scratch / f"{method}-r{round_no}.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.bench_core",
        "--worker",
        method,
        "--size-gb",
        str(args.size_gb),
        "--repeats",
        str(args.repeats),
        "--regime",
        args.regime,
        "--load-cache",
        args.load_cache,
        "--seed",
        str(args.seed),
        *(["--torch-threads", str(args.torch_threads)] if args.torch_threads else []),
        "--op-timeout",
        str(args.op_timeout),
        "--dir",
        str(wdir),
        "--result",
        str(result),
    ]
    timeout = worker_timeout(args)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, stdout=sys.stderr, stderr=sys.stderr, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        shutil.rmtree(wdir, ignore_errors=True)
        return {"method": method, "error": f"worker timed out after {timeout:.0f} s (raise it with --timeout)"}
    finally:
        shutil.rmtree(wdir, ignore_errors=True)
    wall = time.perf_counter() - t0
    if result.is_file():
        res: dict[str, Any] = json.loads(result.read_text())
        result.unlink()
    else:
        res = {"method": method, "error": f"worker exited with status {proc.returncode} and no result"}
    if proc.returncode != 0 and "error" not in res:
        res["error"] = f"worker exited with status {proc.returncode}"
    res["wall_s"] = wall
    return res


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(runs: dict[str, list[dict[str, Any]]], state_bytes: int) -> dict[str, Any]:
    saves: dict[str, Any] = {}
    loads: dict[str, Any] = {}
    errors: dict[str, list[str]] = {}
    floor: dict[str, Any] | None = None
    for method, results in runs.items():
        ok = [r for r in results if "error" not in r]
        for r in results:
            if "error" in r:
                errors.setdefault(method, []).append(r["error"])
        if not ok:
            continue
        if method == FLOOR:
            copies = [t for r in ok for t in r["copy_s"]]
            copy_s = median(copies)
            floor = {
                "copy_s": copy_s,
                "gbps": state_bytes / copy_s / GB if copy_s else None,
                "first_touch_copy_s": median([r["first_touch_copy_s"] for r in ok]),
                "peak_extra_rss_gb": max(r["peak_extra_rss_gb"] for r in ok),
                "all_copy_s": copies,
            }
            continue
        recs = [s for r in ok for s in r["saves"]]
        durable = median([s["durable_s"] for s in recs])
        hwms = [r["peak_extra_hwm_gb"] for r in ok if r.get("peak_extra_hwm_gb") is not None]
        entry = {
            "label": LABELS[method],
            "blocking_s": median([s["blocking_s"] for s in recs]),
            "durable_s": durable,
            "gbps": state_bytes / durable / GB if durable else None,
            "first_blocking_s": median([r["first"]["blocking_s"] for r in ok]),
            "first_durable_s": median([r["first"]["durable_s"] for r in ok]),
            "peak_extra_rss_gb": max(r["peak_extra_rss_gb"] for r in ok),
            "peak_extra_hwm_gb": max(hwms) if hwms else None,
            "retained_rss_gb": max(r["retained_rss_gb"] for r in ok),
            "ckpt_bytes": recs[-1]["ckpt_bytes"] if recs else None,
            "all_blocking_s": [s["blocking_s"] for s in recs],
            "all_durable_s": [s["durable_s"] for s in recs],
        }
        for extra in ("state_dict_s", "lib_staging_s", "lib_staged_s", "lib_persist_s"):
            vals = [s[extra] for s in recs if extra in s]
            if vals:
                entry[extra] = median(vals)
        saves[method] = entry
        for r in ok:
            if "load" in r:
                ld = r["load"]
                agg = loads.setdefault(ld["name"], {"label": LABELS[ld["name"]], "cache": ld["cache"], "records": []})
                agg["records"].extend(ld["loads"])
    for agg in loads.values():
        recs = agg.pop("records")
        t = median([x["load_s"] for x in recs])
        agg.update(
            load_s=t,
            gbps=state_bytes / t / GB if t else None,
            first_load_s=recs[0]["load_s"],
            all_load_s=[x["load_s"] for x in recs],
            verified=all(x["verified"] for x in recs),
            in_place=all(x["in_place"] for x in recs),
            peak_extra_rss_gb=max(x["peak_extra_rss_gb"] for x in recs),
        )
        if any("set_state_dict_s" in x for x in recs):
            agg["set_state_dict_s"] = median([x["set_state_dict_s"] for x in recs if "set_state_dict_s" in x])
    for ref_name, ref_key in (("torch_save", "vs_torch_save"), ("dcp_async", "vs_dcp_async")):
        ref = saves.get(ref_name)
        if ref is None:
            continue
        for entry in saves.values():
            entry[ref_key] = {
                "blocking_speedup": ref["blocking_s"] / entry["blocking_s"] if entry["blocking_s"] else None,
                "durable_speedup": ref["durable_s"] / entry["durable_s"] if entry["durable_s"] else None,
            }
    return {"saves": saves, "loads": loads, "floor": floor, "errors": errors}


def _f(x: float | None, fmt: str = ".3f", suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{fmt}}{suffix}"


def tables(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [
        f"Save ({meta['regime']} page-cache regime; {meta['state_gb']:.2f} GB state, {meta['num_tensors']} tensors; "
        f"medians of {meta['repeats'] * meta['rounds']} saves after one warm-up; speedup = reference time / this time)",
        "",
        "| method | blocking s | until durable s | GB/s (durable) | first-call blocking s | peak extra RSS GB "
        "| speedup vs torch.save (block / durable) | speedup vs DCP async (block / durable) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for method in SAVE_METHODS:
        if method not in meta["methods"]:
            continue
        e = summary["saves"].get(method)
        if e is None:
            lines.append(f"| {LABELS[method]} | failed | | | | | | |")
            continue

        def sp(key: str, e: dict[str, Any] = e) -> str:
            v = e.get(key)
            if v is None:
                return "n/a"
            return f"{_f(v['blocking_speedup'], '.2f', 'x')} / {_f(v['durable_speedup'], '.2f', 'x')}"

        lines.append(
            f"| {e['label']} | {_f(e['blocking_s'])} | {_f(e['durable_s'])} | {_f(e['gbps'], '.2f')} "
            f"| {_f(e['first_blocking_s'])} | {_f(e['peak_extra_rss_gb'], '.2f')} | {sp('vs_torch_save')} "
            f"| {sp('vs_dcp_async')} |"
        )
    lines += [
        "",
        "Blocking: time training is stalled, state-dict construction included. Until durable: torch.save fsyncs its "
        "file; DCP fsyncs its files, not the directory; stashpoint fsyncs files and directory and commits atomically. "
        "Peak extra RSS: the worker's peak RSS during the saves minus its RSS once the state was built (page cache "
        "not counted).",
    ]
    ov = summary["saves"].get("stashpoint_overlap")
    if ov and ov.get("lib_staged_s") is not None:
        lines += [
            "",
            f"Overlap: the call returned after {_f(ov['blocking_s'])} s; every tensor was copied "
            f"{_f(ov['lib_staged_s'])} s after the call (an optimizer step that came sooner would have waited).",
        ]
    fl = summary["floor"]
    if fl:
        lines += [
            "",
            f"Floor: `copy_` of the whole state into already-touched, reused host buffers: {_f(fl['copy_s'])} s "
            f"({_f(fl['gbps'], '.1f')} GB/s); the same copy into fresh memory (first touch): "
            f"{_f(fl['first_touch_copy_s'])} s.",
        ]
    if any(m in meta["methods"] for m in LOAD_OF):
        cache = meta["load_cache"]
        what = (
            "hot page cache: the checkpoint was just written"
            if cache == "hot"
            else "checkpoint files evicted from the page cache before each load"
        )
        lines += [
            "",
            f"Load into the already-allocated live state ({what}; median of {meta['repeats'] * meta['rounds']})",
            "",
            "| method | load s | GB/s | first load s | verified | in place (live tensors kept) |",
            "|---|---:|---:|---:|---|---|",
        ]
        for method, name in LOAD_OF.items():
            if method not in meta["methods"]:
                continue
            e = summary["loads"].get(name)
            if e is None:
                lines.append(f"| {LABELS[name]} | failed | | | | |")
                continue
            lines.append(
                f"| {e['label']} | {_f(e['load_s'])} | {_f(e['gbps'], '.2f')} | {_f(e['first_load_s'])} "
                f"| {'yes' if e['verified'] else 'NO'} | {'yes' if e['in_place'] else 'no'} |"
            )
    if summary["errors"]:
        lines += ["", "Errors:"] + [f"- {m}: {'; '.join(errs)}" for m, errs in summary["errors"].items()]
    return "\n".join(lines)


def results_md(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    head = (
        f"### Core benchmark, {meta['date']}: {meta['regime']} regime, {meta['state_gb']:.2f} GB state\n\n"
        f"{meta['machine']['cpus']} CPUs, {meta['machine']['ram_gib']:.0f} GiB RAM, torch {meta['torch']}, "
        f"stashpoint {meta['stashpoint']} ({meta['commit']}); model {meta['shape']['layers']} layers x "
        f"{meta['shape']['width']} wide, vocab {meta['shape']['vocab']}, + AdamW after one step; each method in its "
        f"own process; scratch under {meta['scratch_base']}.\n\n"
    )
    return head + tables(summary, meta) + f"\n\nCommand: `{meta['command']}`\n"


def _read_sys(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def git_commit() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def orchestrate(args: argparse.Namespace) -> int:
    import psutil

    shape = choose_shape(args.size_gb)
    state_bytes = shape.state_bytes
    methods = [m for m in ALL_WORKERS if m in args.methods]
    base = Path(args.dir) if args.dir else default_scratch_base()
    base.mkdir(parents=True, exist_ok=True)
    free_disk = shutil.disk_usage(base).free
    if free_disk < 2.5 * state_bytes:
        log(f"error: {base} has {free_disk / GB:.1f} GB free; this run needs about {2.5 * state_bytes / GB:.1f} GB")
        return 2
    avail = psutil.virtual_memory().available
    if avail < 4 * state_bytes:
        log(
            f"warning: {avail / GB:.1f} GB of memory available for a {state_bytes / GB:.2f} GB state; the methods "
            "need up to ~3x the state (state + staged copy + allocator slack), so figures may suffer from swapping"
        )
    load1 = os.getloadavg()[0]
    if load1 > 0.5 * (os.cpu_count() or 1):
        log(
            f"warning: load average {load1:.2f} on {os.cpu_count()} CPUs: something else is running, and the figures "
            "will be noisy (only ratios measured in one run are comparable, and only on a quiet machine)"
        )
    scratch = Path(tempfile.mkdtemp(prefix="stashpoint-bench-", dir=base))
    log(
        f"state {state_bytes / GB:.3f} GB: {shape.layers} layers x {shape.width} wide, vocab {shape.vocab}, "
        f"{4 * shape.num_param_tensors} tensors; regime {args.regime}; scratch {scratch}; "
        f"per-worker timeout {worker_timeout(args):.0f} s"
    )
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    try:
        for rnd in range(args.rounds):
            for i, method in enumerate(methods):
                log(f"round {rnd + 1}/{args.rounds}, [{i + 1}/{len(methods)}] {method} ...")
                res = spawn(method, args, scratch, rnd)
                if "error" in res:
                    log(f"{method} FAILED: {res['error']}")
                else:
                    log(f"{method} done in {res['wall_s']:.0f} s")
                runs[method].append(res)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    measured = [r for rs in runs.values() for r in rs if "state_bytes" in r]
    if measured:
        state_bytes = measured[0]["state_bytes"]
    summary = summarize(runs, state_bytes)
    import torch

    try:
        import stashpoint

        sp_version = stashpoint.__version__
    except Exception as e:  # the library under test may be mid-edit; the figures are still worth keeping
        sp_version = f"unavailable ({type(e).__name__}: {e})"

    meta = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "python -m benchmarks.bench_core " + " ".join(sys.argv[1:]),
        "regime": args.regime,
        "methods": methods,
        "load_cache": args.load_cache,
        "cold_sleep_s": COLD_SLEEP_S if args.regime == "cold" else 0.0,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "seed": args.seed,
        "state_gb": state_bytes / GB,
        "state_bytes": state_bytes,
        "num_tensors": measured[0]["num_tensors"] if measured else 4 * shape.num_param_tensors,
        "shape": asdict(shape),
        "torch": torch.__version__,
        "stashpoint": sp_version,
        "commit": git_commit(),
        "scratch_base": str(base),
        "machine": {
            "cpus": os.cpu_count(),
            "ram_gib": psutil.virtual_memory().total / 2**30,
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_start": load1,
            "loadavg_end": os.getloadavg(),
            "torch_threads": measured[0]["torch_threads"] if measured else None,
            "transparent_hugepage": _read_sys("/sys/kernel/mm/transparent_hugepage/enabled"),
            "transparent_hugepage_defrag": _read_sys("/sys/kernel/mm/transparent_hugepage/defrag"),
        },
    }
    text = tables(summary, meta)
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=2, default=str) + "\n")
        log(f"wrote {out}")
    if args.markdown:
        md = results_md(summary, meta)
        if args.markdown == "-":
            print("\n" + md)
        else:
            p = Path(args.markdown)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(md)
            log(f"wrote {p}")
    return 1 if summary["errors"] else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_core",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--size-gb", type=float, default=2.5, help="training state size: weights + AdamW moments (GB)")
    ap.add_argument("--repeats", type=int, default=3, help="measured saves (and loads) per method, after one warm-up")
    ap.add_argument("--rounds", type=int, default=1, help="run every method this many times, interleaved")
    ap.add_argument("--regime", choices=("hot", "cold"), default="cold", help="page-cache regime (see ANCHORS.md)")
    ap.add_argument(
        "--load-cache",
        choices=("hot", "evicted"),
        default="hot",
        help="loads read a just-written checkpoint (hot) or one whose pages were evicted with fadvise (evicted)",
    )
    ap.add_argument("--methods", nargs="+", choices=ALL_WORKERS, default=list(ALL_WORKERS), help="subset to run")
    ap.add_argument("--out", default="benchmarks/out/core.json", help="JSON results ('' to skip)")
    ap.add_argument("--markdown", default=None, help="write a RESULTS.md-ready block to this file ('-' for stdout)")
    ap.add_argument("--dir", default=None, help="scratch base directory (default: /var/tmp or /tmp on the repo's disk)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads in every worker")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per worker process (default: from the size)")
    ap.add_argument("--op-timeout", type=float, default=None, help="seconds to wait for one async save")
    ap.add_argument("--worker", choices=ALL_WORKERS, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.size_gb <= 0 or args.repeats < 1 or args.rounds < 1:
        ap.error("--size-gb must be > 0, --repeats and --rounds >= 1")
    if args.op_timeout is None:
        args.op_timeout = 60.0 + 60.0 * args.size_gb
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is None:
        return orchestrate(args)
    try:
        res = worker(args)
        code = 0
    except BaseException as e:  # report every failure, then exit non-zero
        traceback.print_exc()
        res = {"method": args.worker, "error": f"{type(e).__name__}: {e}"}
        code = 1
    if args.result:
        tmp = Path(args.result + ".tmp")
        tmp.write_text(json.dumps(res, default=str))
        tmp.replace(args.result)
    return code


if __name__ == "__main__":
    sys.exit(main())
