"""Saves until durable and loads of a state of many small tensors, against ``torch.save`` and DCP.

    python -m benchmarks.experiments.many_tensors_durable [--params 10000] [--floats 64] [--trials 3]

``--params`` parameters of ``--floats`` floats with AdamW (40k tensors for 10k parameters, like
a mixture-of-experts model's many small weights): the bytes are few, so each method's time is
its per-tensor work. Each trial runs every method in fresh processes, in turn: one process saves
twice (the first save of a process, then a second one of the same structure, each until
durable: ``stashpoint.save``, ``torch.save`` of the state dicts, ``dcp.save`` of
``get_state_dict``), another builds a fresh model and a fresh optimizer and loads the first
save, timed, and checks every value bitwise (``stashpoint.load``; ``torch.load`` with
``load_state_dict``; ``dcp.load`` with ``get_state_dict``/``set_state_dict``). Prints each
method's times and the medians' ratios to stashpoint's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

METHODS = ("stashpoint", "torch", "dcp")


def _build(params: int, floats: int, fill: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.p = torch.nn.ParameterList(
        torch.nn.Parameter(torch.randn(floats) if fill else torch.zeros(floats)) for _ in range(params)
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if fill:
        for p in model.p:
            p.grad = torch.ones_like(p)
        optim.step()
    return model, optim


def _save(method: str, model: torch.nn.Module, optim: torch.optim.Optimizer, path: Path) -> None:
    if method == "stashpoint":
        import stashpoint

        stashpoint.save({"model": model, "optim": optim}, path)
    elif method == "torch":
        torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, path)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))


def _load(method: str, model: torch.nn.Module, optim: torch.optim.Optimizer, path: Path) -> None:
    if method == "stashpoint":
        import stashpoint

        stashpoint.load({"model": model, "optim": optim}, path)
    elif method == "torch":
        sd = torch.load(path, mmap=True, weights_only=True)
        model.load_state_dict(sd["model"])
        optim.load_state_dict(sd["optim"])
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(model, optim)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(path))
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def _child(role: str, method: str, params: int, floats: int, path: Path) -> dict[str, Any]:
    warnings.filterwarnings("ignore")  # DCP's warning that it saves in a single process
    if role == "save":
        model, optim = _build(params, floats, fill=True)
        times = []
        for name in ("first", "again"):
            t0 = time.perf_counter()
            _save(method, model, optim, path / f"{method}-{name}")
            times.append(time.perf_counter() - t0)
        return {"first": times[0], "again": times[1]}
    saved, saved_optim = _build(params, floats, fill=True)
    model, optim = _build(params, floats, fill=False)  # a restart: a fresh model and optimizer
    t0 = time.perf_counter()
    _load(method, model, optim, path / f"{method}-first")
    took = time.perf_counter() - t0
    for p, q in zip(saved.parameters(), model.parameters(), strict=True):
        want, got = saved_optim.state[p], optim.state[q]
        if not (torch.equal(p, q) and all(torch.equal(want[k], got[k]) for k in ("exp_avg", "exp_avg_sq", "step"))):
            raise SystemExit(f"{method}: a loaded value differs from the saved one")
    return {"load": took}


def _run(role: str, method: str, args: argparse.Namespace, path: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", __spec__.name if __spec__ else "benchmarks.experiments.many_tensors_durable"]
    cmd += ["--child", role, method, str(path), "--params", str(args.params), "--floats", str(args.floats)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=10_000, help="parameters (default 10,000)")
    ap.add_argument("--floats", type=int, default=64, help="floats per parameter (default 64)")
    ap.add_argument("--trials", type=int, default=3, help="trials, each running every method (default 3)")
    ap.add_argument("--child", nargs=3, metavar=("ROLE", "METHOD", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        role, method, where = args.child
        print(json.dumps(_child(role, method, args.params, args.floats, Path(where))))
        return
    times: dict[str, dict[str, list[float]]] = {m: {"first": [], "again": [], "load": []} for m in METHODS}
    for trial in range(args.trials):
        for method in METHODS:
            with tempfile.TemporaryDirectory(prefix="many-durable-", dir="/var/tmp") as scratch:
                for role in ("save", "load"):
                    for k, v in _run(role, method, args, Path(scratch)).items():
                        times[method][k].append(v)
        print(f"trial {trial + 1}/{args.trials} done", file=sys.stderr)
    print(
        f"{args.params} parameters of {args.floats} floats with AdamW ({4 * args.params} tensors), {args.trials} trials"
    )
    med = {m: {k: statistics.median(v) for k, v in t.items()} for m, t in times.items()}
    for phase, what in (("first", "first save"), ("again", "second save"), ("load", "load")):
        row = [f"{m} {med[m][phase]:.2f} s ({', '.join(f'{x:.2f}' for x in times[m][phase])})" for m in METHODS]
        ratios = ", ".join(f"{m} x{med[m][phase] / med['stashpoint'][phase]:.2f}" for m in METHODS[1:])
        print(f"{what}: {'; '.join(row)}; {ratios}")


if __name__ == "__main__":
    main()
