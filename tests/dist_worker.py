"""One rank of a multi-process test (run by tests/dist_util.run_world as a real process).

    python dist_worker.py SCENARIO ARGS...   (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment)

Each scenario prints one JSON line "RESULT {...}" with what the test checks.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import stashpoint
from stashpoint._core.naming import MANIFEST_NAME
from stashpoint._storage import LocalStorage

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])


def result(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def full_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Global tensors every rank can rebuild (uneven sizes on purpose)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(13, 7, generator=g),
        "b": torch.randn(10, 9, generator=g, dtype=torch.float64),
        "c": torch.randint(0, 100, (5,), generator=g),
        "d": torch.randn(6, 8, generator=g).to(torch.bfloat16),
    }


def placements(kind: str):
    from torch.distributed.tensor import Replicate, Shard

    return {
        "s0": [Shard(0)],
        "s1": [Shard(1)],
        "rep": [Replicate()],
        "s0s1": [Shard(0), Shard(1)],
        "s1rep": [Shard(1), Replicate()],
        "reps0": [Replicate(), Shard(0)],
    }[kind]


def mesh_for(kind: str):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, WORLD // 2) if len(placements(kind)) == 2 else (WORLD,))


def dtensor_state(kind: str, seed: int = 0) -> dict:
    from torch.distributed.tensor import distribute_tensor

    mesh = mesh_for(kind)
    pl = placements(kind)
    # "c" is 1-D: shard it on dim 0 only
    out = {}
    for k, t in full_tensors(seed).items():
        p = [q if (t.dim() > 1 or getattr(q, "dim", 0) == 0) else placements("rep")[0] for q in pl]
        out[k] = distribute_tensor(t, mesh, p)
    return out


def main() -> None:
    scenario, args = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    globals()["scenario_" + scenario](*args)
    sys.stdout.flush()
    # torch 2.13 sometimes aborts ("terminate called without an active exception") while tearing
    # down gloo groups after DTensor collectives, even without stashpoint; the scenario's result
    # is already out, so leave without the teardown.
    os._exit(0)


# ------------------------------------------------------------------------------------------------


def scenario_ddp_save(path: str) -> None:
    m = model()
    ddp = torch.nn.parallel.DistributedDataParallel(m)
    optim = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    for i in range(3):
        torch.manual_seed(100 + RANK * 7 + i)
        ddp(torch.randn(4, 16)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    rng = stashpoint.RNGState()
    torch.manual_seed(1000 + RANK)  # per-rank RNG state
    state = {"model": ddp, "optim": optim, "rng": rng, "step": 3, "rank_note": f"rank {RANK}"}
    ref = {k: v.clone() for k, v in m.state_dict().items()}  # the state at the moment of the save
    h = stashpoint.async_save(state, path, timeout=60)
    expected_next = torch.rand(3).tolist()
    ddp(torch.randn(4, 16)).sum().backward()  # training goes on (an all-reduce on the default group)
    optim.step()
    stats = h.wait()
    if RANK == 0:
        torch.save({"model": ref}, path + ".ref.pt")
    result(bytes=stats.bytes_written, rng_next=expected_next)


def scenario_ddp_load(path: str) -> None:
    m = model(seed=99)
    optim = torch.optim.AdamW(m.parameters(), lr=1e-2)
    state = {"model": m, "optim": optim, "rng": stashpoint.RNGState(), "step": 0, "rank_note": ""}
    stashpoint.load(state, path)
    ref = torch.load(path + ".ref.pt", weights_only=True)["model"]
    same = all(torch.equal(ref[k], v) for k, v in m.state_dict().items())
    result(
        same=same,
        step=state["step"],
        note=state["rank_note"],
        rng_next=torch.rand(3).tolist(),
        has_optim_state=len(optim.state) == 4,
    )


class _CountingStorage(LocalStorage):
    read_bytes = 0

    def readv(self, name, offset, buffers):
        type(self).read_bytes += sum(len(b) for b in buffers)
        super().readv(name, offset, buffers)


def scenario_ddp_load_count(path: str, exchange: str) -> None:
    m = model(seed=99)
    optim = torch.optim.AdamW(m.parameters(), lr=1e-2)
    state = {"model": m, "optim": optim, "rng": stashpoint.RNGState(), "step": 0, "rank_note": ""}
    stashpoint.load(state, _CountingStorage(path), exchange=exchange == "1", timeout=60)
    ref = torch.load(path + ".ref.pt", weights_only=True)["model"]
    same = all(torch.equal(ref[k], v) for k, v in m.state_dict().items())
    exp_avg = [optim.state[p]["exp_avg"].sum().item() for p in m.parameters()]
    result(same=same, read=_CountingStorage.read_bytes, exp_avg=exp_avg, note=state["rank_note"])


def scenario_dtensor_save(path: str, kind: str) -> None:
    state = {"t": dtensor_state(kind), "step": 1}
    stats = stashpoint.save(state, path, timeout=60)
    result(bytes=stats.bytes_written)


def scenario_dtensor_load(path: str, kind: str) -> None:
    state = {"t": dtensor_state(kind, seed=5), "step": 0}  # different values, same shapes
    stashpoint.load(state, path)
    ok = {k: torch.equal(v.full_tensor(), full_tensors()[k]) for k, v in state["t"].items()}
    result(ok=ok, step=state["step"])


def scenario_plain_load(path: str) -> None:
    """Load a sharded checkpoint into plain (unsharded) tensors, e.g. on one process."""
    full = full_tensors()
    state = {"t": {k: torch.zeros_like(v) for k, v in full.items()}, "step": 0}
    stashpoint.load(state, path)
    result(ok={k: torch.equal(v, full[k]) for k, v in state["t"].items()})


def scenario_rng_resume(path: str) -> None:
    """Resume a checkpoint one process saved (with its RNG state) on every rank: the warnings."""
    import logging

    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("stashpoint").addHandler(handler)
    stashpoint.load({"w": torch.zeros(8), "rng": stashpoint.RNGState()}, path)
    result(warnings=seen)


def scenario_plain_save(path: str) -> None:
    stashpoint.save({"t": full_tensors(), "step": 1}, path)
    result()


def _fsdp_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    m = model()
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def scenario_fsdp_save(path: str) -> None:
    m = _fsdp_model()
    optim = torch.optim.AdamW(m.parameters(), lr=1e-2)
    torch.manual_seed(3)
    x = torch.randn(4, 16)
    for _ in range(2):
        m(x).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    stashpoint.save({"model": m, "optim": optim}, path)
    full = {k: v.full_tensor() for k, v in m.state_dict().items()}
    moments = {n: optim.state[p]["exp_avg"].full_tensor() for n, p in m.named_parameters()}
    if RANK == 0:
        torch.save({"model": full, "exp_avg": moments}, path + ".ref.pt")
    result()


def scenario_rewind_refused(root: str) -> None:
    """A rewind whose step rank 0 (the root's owner) cannot move aside: refused on every rank
    together, and the save once the cause is gone goes on everywhere."""
    from stashpoint._storage import LocalStorage

    def state(v: float) -> dict:
        return {"w": torch.full((4,), float(v))}

    out = {}
    with stashpoint.CheckpointManager(root, keep_last=None) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, state(s), timeout=30).wait()
        mgr.restore(state(0), step=1)
        real = LocalStorage.move
        if RANK == 0:

            def refuse(self, name):  # type: ignore[no-untyped-def]
                raise PermissionError(13, "Permission denied (injected)", str(self.root))

            LocalStorage.move = refuse  # type: ignore[method-assign]
        for attempt in ("first", "second"):
            t0 = time.monotonic()
            try:
                mgr.save(2, state(20), timeout=30)
                mgr.wait()
                out[attempt] = "ok"
            except stashpoint.CheckpointError as e:
                out[attempt] = str(e)[:3000]
            out[f"{attempt}_s"] = time.monotonic() - t0
            LocalStorage.move = real  # type: ignore[method-assign]
        out["steps"] = mgr.steps()
    result(**out)


def scenario_gather_root_long(_: str) -> None:
    """Rank 0's own long message (a remote tier's listing) neither travels nor pads the others'."""
    from stashpoint._dist import group as _group

    ctx = _group.context(None, 60)
    long = "x" * 100_000
    got = ctx.gather("a gather", long if RANK == 0 else RANK)
    result(ok=got is None if RANK else got == [long, *range(1, WORLD)], received=ctx.received)


def scenario_tree_max(_: str) -> None:
    """The preemption check's all-reduce (a tree up and a broadcast down) on a new gloo group."""
    from stashpoint._dist.gloo import gloo_group, tree_max

    group = gloo_group(lazy=True)  # as from LAZY_FROM_RANKS ranks: connected as the tree goes
    values = [(r * 7) % 5 for r in range(WORLD)]
    flag = torch.tensor([values[RANK], RANK, -RANK], dtype=torch.int64)
    tree_max(flag, group)
    result(got=flag.tolist(), want=[max(values), WORLD - 1, 0])


def scenario_fsdp_save_dicts(path: str) -> None:
    """FSDP2, saved as DCP's ``get_state_dict`` dicts (the optimizer's keyed by parameter name)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m = _fsdp_model()
    optim = torch.optim.AdamW(m.parameters(), lr=1e-2)
    torch.manual_seed(3)
    m(torch.randn(4, 16)).pow(2).mean().backward()
    optim.step()
    msd, osd = get_state_dict(m, optim)
    stashpoint.save({"model": msd, "optim": osd}, path)
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path + "-dcp")
    moments = {n: optim.state[p]["exp_avg"].full_tensor() for n, p in m.named_parameters()}
    if RANK == 0:
        torch.save({"exp_avg": moments}, path + ".ref.pt")
    result()


def scenario_fsdp_load_modules(path: str) -> None:
    """A fresh FSDP2 model and optimizer, given as objects, load what ``fsdp_save_dicts`` saved:
    the moments made like their parameters (DTensors: each rank reads its slice), and a step."""
    m = _fsdp_model()
    optim = torch.optim.AdamW(m.parameters(), lr=1e-2)
    stashpoint.load({"model": m, "optim": optim}, path)
    ref = torch.load(path + ".ref.pt", weights_only=True)
    kinds = sorted({type(optim.state[p]["exp_avg"]).__name__ for p in m.parameters()})
    same = all(torch.equal(ref["exp_avg"][n], optim.state[p]["exp_avg"].full_tensor()) for n, p in m.named_parameters())
    m(torch.randn(4, 16)).pow(2).mean().backward()
    optim.step()
    result(kinds=kinds, same_moments=same)


def scenario_fsdp_to_plain(path: str) -> None:
    """FSDP2 on N ranks -> a plain model and optimizer on this (single) process."""
    m = model(seed=42)
    optim = torch.optim.AdamW(m.parameters(), lr=1e-2)
    stashpoint.load({"model": m, "optim": optim}, path)
    ref = torch.load(path + ".ref.pt", weights_only=True)
    same_model = all(torch.equal(ref["model"][k], v) for k, v in m.state_dict().items())
    same_moments = all(torch.equal(ref["exp_avg"][n], optim.state[p]["exp_avg"]) for n, p in m.named_parameters())
    result(same_model=same_model, same_moments=same_moments)


def scenario_fsdp_unsharded_names(path: str) -> None:
    """FSDP2 that keeps its root unsharded after a forward (``reshard_after_forward=False``), with
    the optimizer ahead of the model in the state: after a no-grad forward, named_parameters()
    gives the full tensors, not the DTensors the optimizer holds."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def build():
        m = fully_shard(model(), mesh=init_device_mesh("cpu", (WORLD,)), reshard_after_forward=False)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    m, optim = build()
    m(torch.randn(4, 16)).pow(2).mean().backward()
    optim.step()
    with torch.no_grad():
        m(torch.randn(4, 16))  # an evaluation: the root stays unsharded
    stashpoint.save({"optim": optim, "model": m}, path)
    saved_keys = sorted(map(str, stashpoint.read(path)["optim"]["state"]))
    m2, optim2 = build()
    with torch.no_grad():
        m2(torch.randn(4, 16))
    stashpoint.load({"optim": optim2, "model": m2}, path)
    same = all(
        torch.equal(optim.state[p]["exp_avg"].full_tensor(), optim2.state[q]["exp_avg"].full_tensor())
        for p, q in zip(m.parameters(), m2.parameters())
    )
    result(saved_keys=saved_keys, same_moments=same)


def scenario_zero_refused(path: str) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    m = model()
    optim = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    m(torch.randn(4, 16)).sum().backward()
    optim.step()
    errors = []
    try:
        stashpoint.save({"model": m, "optim": optim}, path)
    except stashpoint.UnsupportedStateError as e:
        errors.append(str(e))
    exists = os.path.exists(path)
    stashpoint.save({"model": m, "optim": {}}, path)
    try:
        stashpoint.load({"model": m, "optim": optim}, path)
    except stashpoint.UnsupportedStateError as e:
        errors.append(str(e))
    result(errors=errors, exists=exists)


def scenario_train_loop(root: str, steps: str) -> None:
    """All-reduce on the default group every step while saves coordinate in the background."""
    m = torch.nn.parallel.DistributedDataParallel(model())
    optim = torch.optim.SGD(m.parameters(), lr=0.01)
    with stashpoint.CheckpointManager(root, keep_last=2, every_steps=3) as mgr:
        for step in range(1, int(steps) + 1):
            torch.manual_seed(step * 10 + RANK)
            m(torch.randn(8, 16)).pow(2).mean().backward()
            optim.step()
            optim.zero_grad()
            t = torch.tensor([float(step)])
            dist.all_reduce(t)  # the training's own collective, every step
            assert t.item() == step * WORLD
            mgr.maybe_save(step, {"model": m, "optim": optim, "step": step}, metrics={"loss": 1.0 / step})
        mgr.wait()
        metrics_kept = len(mgr._metrics)
    steps_seen = mgr.steps()
    # every rank holds identical parameters (DDP) after training
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(WORLD)]
    dist.all_gather(gathered, flat)
    result(
        replicas_equal=all(torch.equal(g, gathered[0]) for g in gathered), steps=steps_seen, metrics_kept=metrics_kept
    )


class _KillOnWrite(LocalStorage):
    def open_writer(self, name, size):
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")


class _StallOnWrite(LocalStorage):
    seconds = 20.0

    def open_writer(self, name, size):
        time.sleep(self.seconds)
        return super().open_writer(name, size)


def scenario_fail_mid_save(path: str, victim: str, how: str) -> None:
    """A save whose rank ``victim`` dies (how=kill) or stalls (how=stall) while writing."""
    state = {"w": torch.full((1000,), float(RANK)), "x": torch.ones(10)}
    stashpoint.save(state, path + "-prev", timeout=10)  # an earlier checkpoint that must survive
    faulty = {"kill": _KillOnWrite, "stall": _StallOnWrite}[how]
    storage = faulty(path) if int(victim) == RANK else LocalStorage(path)
    t0 = time.perf_counter()
    h = stashpoint.async_save(state, storage, timeout=10)
    try:
        h.wait(timeout=120)
        result(raised=False)
    except stashpoint.CheckpointError as e:
        result(raised=True, seconds=time.perf_counter() - t0, message=str(e))
    os._exit(0)  # the group lost a member: skip the orderly shutdown


def scenario_fail_planning_files(path: str) -> None:
    """Rank 1 fails while it plans its shard files (after the ranks agreed who writes what): every
    rank must learn it at once, not wait out the timeout for rank 1's outcome."""
    from stashpoint._save import job as _job

    if RANK == 1:

        def fail(self, given):  # type: ignore[no-untyped-def]
            raise MemoryError("injected")

        _job.PersistJob._files = fail  # type: ignore[method-assign]
    state = {"w": torch.full((1000,), float(RANK)), "x": torch.ones(10)}
    t0 = time.perf_counter()
    try:
        stashpoint.save(state, path, timeout=60)
        result(raised=False)
    except stashpoint.CheckpointError as e:
        result(raised=True, seconds=time.perf_counter() - t0, message=str(e))


def scenario_slow_commit(path: str, delay: str) -> None:
    """Rank 0 takes ``delay`` seconds to commit, past the 4 s timeout of the others' wait for it:
    the save must end committed and whole, or not committed, never committed without shards."""
    from stashpoint._save import job as _job

    if RANK == 0:
        real = _job.PersistJob._commit

        def slow(self, *args, **kwargs):
            time.sleep(float(delay))
            return real(self, *args, **kwargs)

        _job.PersistJob._commit = slow
    state = {"w": torch.full((1000,), float(RANK + 1)), "x": torch.ones(10)}
    t0 = time.perf_counter()
    try:
        stashpoint.save(state, path, timeout=4)
        outcome = {"raised": False}
    except stashpoint.CheckpointError as e:
        outcome = {"raised": True, "message": str(e)}
    outcome["seconds"] = time.perf_counter() - t0
    time.sleep(float(delay) + 3 - min(outcome["seconds"], float(delay)))  # rank 0 is done by now
    dist.barrier()  # the training's group: both ranks look at the result together
    committed = Path(path, MANIFEST_NAME).exists()
    ok = stashpoint.verify(path).ok if committed else None
    result(committed=committed, verified=ok, **outcome)
    os._exit(0)


def scenario_plan_cache(root: str) -> None:
    """Saves of one structure plan once; the caller's thread never runs a collective."""
    import threading

    from stashpoint._dist import group as _dist

    m = model()
    calls = []
    real = _dist.DistContext.collective

    def spy(self, what, fn, *a, **kw):
        calls.append((what, threading.current_thread().name))
        return real(self, what, fn, *a, **kw)

    _dist.DistContext.collective = spy
    state = {"model": m, "step": 0}
    for i in range(3):
        state["step"] = i
        stashpoint.save(state, f"{root}/a{i}", timeout=60)
    state["extra"] = torch.ones(3)  # a new structure: planned again
    stashpoint.save(state, f"{root}/b", timeout=60)
    ctx = next(iter(_dist._contexts().values()))
    kinds = sorted({w for w, _ in calls})
    result(plans=ctx.plans_made, described=ctx.plans_described, threads=sorted({t for _, t in calls}), kinds=kinds)


def scenario_save_bytes(root: str) -> None:
    """Bytes each rank sends and receives on the checkpoint group, save by save (a DTensor state
    sharded over every rank plus replicated scalars): later saves are O(1) per rank."""
    from stashpoint._dist import group as _dist

    state = {"t": dtensor_state("s0"), "step": torch.tensor(3.0), "note": f"rank {RANK}"}
    per_save = []
    for i in range(4):
        ctx = next(iter(_dist._contexts().values()), None)
        before = (ctx.sent, ctx.received) if ctx is not None else (0, 0)
        stashpoint.save(state, f"{root}/s{i}", timeout=60)
        ctx = next(iter(_dist._contexts().values()))
        per_save.append([ctx.sent - before[0], ctx.received - before[1]])
    result(per_save=per_save, plans=ctx.plans_made)


def scenario_indexes_read(path: str, kind: str, *more: str) -> None:
    """Load checkpoints (``path``, then each of ``more``) and say which ranks' indexes this rank
    read for each, and whether the values came back."""
    from stashpoint._load import manifest as _manifest

    real = _manifest.read_index
    out = []
    for p in (path, *more):
        read = []

        def spy(storage, head, rank, read=read):
            read.append(rank)
            return real(storage, head, rank)

        _manifest.read_index = spy
        state = {"t": dtensor_state(kind, seed=5), "step": 0}
        stashpoint.load(state, p)
        ok = all(torch.equal(v.full_tensor(), full_tensors()[k]) for k, v in state["t"].items())
        out.append({"read": sorted(set(read)), "ok": ok and state["step"] == 1})
    result(loads=out)


def scenario_per_rank_paths(root: str) -> None:
    """Every rank saves to a path of its own (a torch.save habit): the error says so."""
    try:
        stashpoint.save({"w": torch.ones(4)}, f"{root}/ckpt_{RANK}", timeout=30)
        result(error=None)
    except stashpoint.CheckpointError as e:
        result(error=str(e))


def scenario_asym_error(root: str) -> None:
    """Rank 1 alone refuses a value: every rank fails that save, and the next one commits."""
    bad = {"w": torch.ones(4), "cfg": object() if RANK == 1 else 1}
    outcome = {}
    try:
        stashpoint.async_save(bad, f"{root}/a", timeout=30).wait()
        outcome["a"] = "ok"
    except stashpoint.CheckpointError as e:
        outcome["a"] = type(e).__name__ + ": " + str(e)[:2000]
    stashpoint.save({"w": torch.full((4,), 2.0)}, f"{root}/b", timeout=30)
    try:
        with stashpoint.CheckpointManager(f"{root}/run", on_busy="skip") as mgr:
            mgr.save(1, {"w": torch.ones(4)})
        outcome["skip"] = "accepted"
    except ValueError as e:
        outcome["skip"] = str(e)
    result(**outcome)


def scenario_fallback(root: str) -> None:
    """Rank 1's shard of the newest step is damaged: every rank falls back to the same step."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from stashpoint._core.naming import step_dir

    mesh = mesh_for("s0")
    with stashpoint.CheckpointManager(root, keep_last=None) as mgr:
        for step in (1, 2):
            w = distribute_tensor(torch.full((8, 4), float(step)), mesh, [Shard(0)])
            mgr.save(step, {"w": w, "step": step}).wait()
        dist.barrier()
        if RANK == 1:
            from pathlib import Path

            shard = next(p for p in Path(root, step_dir(2)).iterdir() if p.name.startswith("shard-r00001"))
            data = bytearray(shard.read_bytes())
            data[-1] ^= 0xFF
            shard.write_bytes(bytes(data))
        dist.barrier()
        state = {"w": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)]), "step": 0}
        got = mgr.restore(state)
    result(step=got, value=float(state["w"].to_local()[0, 0]), state_step=state["step"])


def scenario_atomic_load(root: str) -> None:
    """Rank 1's shard is damaged; an atomic load raises on every rank and changes nothing anywhere."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = mesh_for("s0")
    stashpoint.save({"w": distribute_tensor(torch.full((8, 4), 5.0), mesh, [Shard(0)]), "step": 9}, root)
    dist.barrier()
    if RANK == 1:
        from pathlib import Path

        shard = next(p for p in Path(root).iterdir() if p.name.startswith("shard-r00001"))
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
    dist.barrier()
    state = {"w": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)]), "step": 0}
    try:
        stashpoint.load(state, root, atomic=True, timeout=60)
        error = ""
    except stashpoint.CheckpointError as e:
        error = type(e).__name__
    result(error=error, untouched=bool((state["w"].to_local() == 0).all()), step=state["step"])


def scenario_torture_loop(root: str) -> None:
    """Save forever through a manager (rank 0 prints each commit) until a rank is killed."""
    state = {"w": torch.zeros(256 * 1024), "step": 0}

    def report(stats: stashpoint.SaveStats) -> None:
        if RANK == 0:
            print(f"committed {stats.step}", flush=True)

    try:
        with stashpoint.CheckpointManager(root, keep_last=2, on_save=report) as mgr:
            step = (mgr.latest_step() or 0) + 1
            while True:
                state["w"].fill_(step)
                state["step"] = step
                mgr.save(step, state, timeout=10)
                step += 1
    except stashpoint.CheckpointError as e:
        result(error=str(e)[:300])
    os._exit(0)


def scenario_recover(root: str) -> None:
    """Rank 1 stalls past the timeout: the save fails on both; once both are back, the next works."""
    state = {f"w{RANK}": torch.full((1000,), float(RANK))}  # each rank writes its own tensor
    _StallOnWrite.seconds = 8.0
    first = _StallOnWrite(f"{root}/a") if RANK == 1 else LocalStorage(f"{root}/a")
    try:
        stashpoint.async_save(state, first, timeout=4).wait()
        outcome = "ok"
    except stashpoint.CheckpointError as e:
        outcome = str(e)[:200]
    dist.barrier()  # the training's own group: the ranks are together again
    stashpoint.save(state, f"{root}/b", timeout=30)
    result(first=outcome, second="ok")
    os._exit(0)


def scenario_mesh_only(path: str, kind: str) -> None:
    st = dtensor_state(kind)
    if "pythreads" in path:
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda v: sum(range(1000)), st.values()))
    elif "threads" in path:
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda v: v.to_local().copy_(torch.zeros_like(v.to_local())), st.values()))
    if "full" in path:
        [v.full_tensor() for v in st.values()]
    result()


def scenario_ddp_partial(root: str, mode: str) -> None:
    """Saves of a DDP state while training goes on: what each rank copies, save by save
    (``mode``: the writer thread, the writer process, or overlap mode)."""
    import copy

    m = model()
    ddp = torch.nn.parallel.DistributedDataParallel(m)
    optim = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    opts = {"process": {"writer": "process"}, "overlap": {"overlap": True}}.get(mode, {})
    out = []
    for i in range(3):
        torch.manual_seed(100 + i)
        ddp(torch.randn(4, 16)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
        state = {"model": ddp, "optim": optim, "step": i}
        if RANK == 0:  # the state at the moment of the save, for the test to compare
            ref = {"model": m.state_dict(), "optim": optim.state_dict()["state"]}
            torch.save(copy.deepcopy(ref), f"{root}/ref{i}.pt")
        h = stashpoint.async_save(state, f"{root}/s{i}", timeout=60, **opts)
        ddp(torch.randn(4, 16)).sum().backward()  # training goes on while it persists
        optim.step()
        optim.zero_grad()
        s = h.wait()
        out.append({"staged": s.staged_bytes, "written": s.rank_bytes_written, "total": s.bytes_written})
    held = sum(t.numel() * t.element_size() for t in m.state_dict().values())
    held += sum(v.numel() * v.element_size() for st in optim.state.values() for v in st.values())
    result(saves=out, held=held)


def scenario_uneven_change(root: str) -> None:
    """Replicated tensors whose ranks' structures change between saves, unevenly."""
    a, b, c = torch.zeros(1000), torch.zeros(1000), torch.zeros(100)
    plans = [
        {"a": a, "b": b},  # 1: every rank copies everything (no plan yet)
        {"a": a, "b": b},  # 2: each rank copies only its part
        {"a": a, "b": b, **({"c": c} if RANK == 1 else {})},  # 3: rank 1 adds a tensor of its own
        {"a": a, "b": b, **({"c": c} if RANK == 1 else {})},  # 4: all once: that plan was constrained
        {"a": a, **({"b": b} if RANK == 0 else {"c": c})},  # 5: b's writer (rank 1) drops it
        {"a": a, **({"b": b} if RANK == 0 else {"c": c})},  # 6: the same again
        {"a": a, **({"b": b} if RANK == 0 else {"c": c})},  # 7: and again
    ]
    out = []
    for k, state in enumerate(plans, start=1):
        a.fill_(k)
        b.fill_(100 + k)
        c.fill_(200 + k)
        try:
            h = stashpoint.async_save(state, f"{root}/s{k}", timeout=60)
            for t in (a, b, c):  # changed at once: the checkpoint holds the values at the call
                t.fill_(-1)
            s = h.wait()
            out.append({"ok": True, "staged": s.staged_bytes, "written": s.rank_bytes_written})
        except stashpoint.CheckpointError as e:
            out.append({"ok": False, "error": str(e)})
    result(saves=out)


def scenario_replica_cached(root: str) -> None:
    """Each rank a node of its own (its own directory), replicas=1: once the save returned, how
    much of the copy this node keeps of the other node's shard is in the page cache."""
    from test_pagecache import wait_resident

    os.environ.update(STASHPOINT_NODE=str(RANK), STASHPOINT_LOCAL_RANK="0")
    g = torch.Generator().manual_seed(0)
    state = {f"w{r}": torch.randn(4 << 20, generator=g) for r in range(WORLD)}  # 16 MiB each: one per rank
    with stashpoint.CheckpointManager(Path(root) / f"node-{RANK}", node_local=True, replicas=1) as mgr:
        mgr.save(1, state)
        mgr.wait()
        other = (RANK + 1) % WORLD
        theirs = sorted((Path(root) / f"node-{RANK}").glob(f"step-*/shard-r{other:05d}-*"))
        cached = wait_resident(theirs, 0.99) if theirs else 0.0
        result(files=len(theirs), size=sum(p.stat().st_size for p in theirs), cached=cached)
        dist.barrier()  # the other node still serves nothing, but leaves with this one


class _Untied(torch.nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.other = torch.nn.Parameter(torch.zeros(rows, 64))  # large first: the writers balance emb and head
        self.emb = torch.nn.Embedding(1000, 64)
        self.head = torch.nn.Linear(64, 1000, bias=False)


def scenario_tied_untied(root: str) -> None:
    """Untied models saved by 2 ranks (replicated), loaded into tied ones: each rank's own index
    lacks the chunks the other rank wrote, so the check needs the writers' indexes."""
    out = {}
    for rows in (1, 2000):
        for values in ("equal", "differ"):
            torch.manual_seed(0)
            m = _Untied(rows)
            if values == "equal":
                with torch.no_grad():
                    m.head.weight.copy_(m.emb.weight)
            path = f"{root}/{rows}-{values}"
            stashpoint.save({"model": m}, path)
            for strict in (True, False):
                t = _Untied(rows)
                t.head.weight = t.emb.weight
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        stashpoint.load({"model": t}, path, strict=strict)
                except stashpoint.StateMismatchError as e:
                    out[f"{rows}-{values}-{strict}"] = "refused" if "tied weights" in str(e) else str(e)
                    continue
                w = t.emb.weight.detach()
                same = [torch.zeros_like(w) for _ in range(WORLD)]
                dist.all_gather(same, w)
                took = "emb" if torch.equal(w, m.emb.weight) else "head" if torch.equal(w, m.head.weight) else "?"
                alike = all(torch.equal(x, same[0]) for x in same)
                out[f"{rows}-{values}-{strict}"] = took if alike else f"{took} apart"
    result(**out)


def scenario_refused_save_after_a_failed_upload(root: str) -> None:
    """Step 1's upload fails; a second save of step 1 is refused (it is committed): step 1,
    uploaded nowhere, must stay on the local tier. Steps 2 and 3 follow with keep_last=1: step
    2's upload commits, and step 1's goes up after it, on both ranks alike."""
    from stashpoint._manager import uploader

    commit, failed = uploader._commit_copy, []

    def fail_once(src, dst, outcomes):  # type: ignore[no-untyped-def]
        if not failed:
            failed.append(1)
            raise stashpoint.CheckpointError("the remote tier is down (injected)")
        return commit(src, dst, outcomes)

    uploader._commit_copy = fail_once
    state = {f"w{RANK}": torch.arange(1000.0)}
    out = {}
    with stashpoint.CheckpointManager(f"{root}/local", keep_last=1, remote_root=f"{root}/remote") as mgr:
        mgr.save(1, state)
        try:
            mgr.wait()
        except stashpoint.CheckpointError:
            out["upload_failed"] = True
        try:
            mgr.save(1, state).wait()
        except stashpoint.CheckpointError as e:
            out["refused"] = "already has a committed checkpoint" in str(e)
        try:
            mgr.wait()
        except stashpoint.CheckpointError:
            pass
        out["after_refused"] = mgr.steps()
        for step in (2, 3):
            mgr.save(step, state).wait()
        mgr.wait()
        out["local"], out["remote"] = mgr.steps(), mgr.remote_steps()
    result(**out)


class _LocalMomentum(torch.optim.Optimizer):
    """An optimizer of one's own under FSDP2 keeping its momentum as a plain tensor the shape
    of the rank's shard, not as a DTensor as torch's optimizers do."""

    def __init__(self, params: object) -> None:
        super().__init__(params, {"lr": 0.1})  # type: ignore[arg-type]

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                grad = p.grad.to_local()
                m = self.state[p].setdefault("m", torch.zeros_like(grad))
                m.mul_(0.9).add_(grad)
                p.to_local().add_(m, alpha=-group["lr"])


def scenario_shard_shaped_optimizer_state(root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from stashpoint._state import stateful

    mesh = init_device_mesh("cpu", (WORLD,))
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("stashpoint").addHandler(handler)
    out = {}
    for rows in (6, 7, 2):  # shards of one size on both ranks, of two, and of one element
        stateful._said_shard_shaped.clear()
        said.clear()
        torch.manual_seed(0)
        model = torch.nn.Linear(8, rows) if rows > 2 else torch.nn.Linear(1, rows, bias=False)
        fully_shard(model, mesh=mesh)
        optim = _LocalMomentum(model.parameters())
        path = f"{root}/{rows}"
        stashpoint.save({"model": model}, path)  # a checkpoint the refused save must leave alone
        torch.manual_seed(RANK)
        model(torch.randn(4, model.in_features)).pow(2).sum().backward()
        optim.step()
        try:
            stashpoint.save({"model": model, "optim": optim}, path, overwrite=True)
            out[str(rows)] = "saved"
        except stashpoint.CheckpointError as e:
            out[str(rows)] = f"{type(e).__name__}: {e}"
        out[f"{rows}-warned"] = [m for m in said if "shaped like this rank's shard" in m]
    result(rank=RANK, **out)


if __name__ == "__main__":
    main()
