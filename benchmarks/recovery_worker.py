"""One node's process of benchmarks/bench_recovery.py (run by torchrun, one rank per node).

    recovery_worker.py BASE PHASE [--size-gb G] [--source own|replica|s3|dcp] [--replicas K]

PHASE ``save``: the suite's GPT + AdamW under FSDP2 (``build("fsdp", ...)``), saved as step 1
three ways: a node-local manager with replicas (BASE/node-<NODE_DIR>/ckpt, or under ``BENCH_NODES``), a manager with an
S3 remote tier (BASE/s3-local, removed afterwards: the restart is a fresh node), and
``dcp.save`` to BASE/dcp. PHASE ``resume``: a fresh state, restored from ``--source``, then one
training step; prints ``RESULT {json}`` with the load's time and the time from the launch
(``BENCH_T0`` in the environment) to the end of that step. PHASE ``train``: 40 steps with a
node-local save at steps 16, 24 and 32 of 40 (``--replicas``); prints each step's time and the
CPU time the process used. PHASE ``cost``: no training, four node-local saves (``--replicas``);
the CPU time the process used and the wall time from each save's call until ``wait()`` returned
(the first save, which allocates its buffers, left out), ``--gap`` seconds apart (a training
run's saves are minutes apart: back to back, a save's writes meet the last one's read-back).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import resource
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import stashpoint
from benchmarks.suite.savers import dcp_loader, fqn_state_dict
from benchmarks.suite.state import build, choose_shape

TRAIN_STEPS = 40
SAVES = (16, 24, 32)  # steps 1-12 without saves give the baseline


def train_step(state: dict) -> None:
    """A step that touches every parameter (the suite's GPT holds state, it has no forward):
    a loss over the parameters, its backward, and AdamW's update."""
    model, optim = state["model"], state["optim"]
    loss = sum((p.float() * 1e-3).square().sum() for p in model.parameters())
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    state["step"] += 1


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each live thread of this process, summed by thread name
    (Linux's ``/proc``; empty elsewhere). Threads that ended between two calls are missing."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path("/proc/self/task").glob("*") if Path("/proc/self/task").is_dir() else ():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = name.rstrip("0123456789_-")  # pool threads counted together
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def node_root(base: Path) -> Path:
    nodes = Path(os.environ.get("BENCH_NODES", base))  # the nodes' tier: a disk, or /dev/shm (memory)
    return nodes / f"node-{os.environ.get('NODE_DIR', os.environ.get('GROUP_RANK', '0'))}" / "ckpt"


@contextlib.contextmanager
def _profiled(source: str, rank: int) -> Iterator[None]:
    """cProfile what runs inside, written to $BENCH_PROFILE/<source>-rank<rank>.prof when that
    directory is set (each rank's restore; for S3, the manager's open too)."""
    where = os.environ.get("BENCH_PROFILE")
    if not where:
        yield
        return
    import cProfile

    with cProfile.Profile() as prof:
        yield
    prof.dump_stats(Path(where) / f"{source}-rank{rank}.prof")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base", type=Path)
    ap.add_argument("phase", choices=("save", "resume", "train", "cost"))
    ap.add_argument("--size-gb", type=float, default=0.5)
    ap.add_argument("--source", default="own")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--s3", default="")
    ap.add_argument("--gap", type=float, default=0.0, help="cost: seconds between a save's wait() and the next save")
    args = ap.parse_args()
    if os.environ.get("BENCH_LOG"):
        logging.basicConfig(level=logging.INFO, format=f"[node {os.environ.get('GROUP_RANK')}] %(message)s")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    state = build("fsdp", choose_shape(args.size_gb), 0, rank, world)
    out: dict = {"rank": rank}
    if args.phase == "save":
        with stashpoint.CheckpointManager(node_root(args.base), node_local=True, replicas=args.replicas) as mgr:
            mgr.save(1, state)
        with stashpoint.CheckpointManager(args.base / "s3-local", remote_root=args.s3) as mgr:
            mgr.save(1, state)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(args.base / "s3-local")
        import torch.distributed.checkpoint as dcp

        dcp.save(fqn_state_dict(state), checkpoint_id=str(args.base / "dcp"))
    elif args.phase == "resume":
        t0 = float(os.environ["BENCH_T0"])
        t1 = time.perf_counter()
        with contextlib.ExitStack() as managers:  # open through the first step, as in a training loop
            if args.source == "dcp":
                dcp_loader(state)(args.base / "dcp")
            elif args.source == "s3":
                fresh = args.base / f"fresh-{os.environ['BENCH_T0']}"  # empty: the local tier of fresh nodes
                with _profiled(args.source, rank):
                    m = managers.enter_context(stashpoint.CheckpointManager(fresh, remote_root=args.s3))
                    assert m.restore(state) == 1 and m.restored_from() == "remote"
            else:
                mgr = stashpoint.CheckpointManager(node_root(args.base), node_local=True, replicas=args.replicas)
                m = managers.enter_context(mgr)
                with _profiled(args.source, rank):
                    assert m.restore(state) == 1
            out["load_s"] = time.perf_counter() - t1
            t2 = time.perf_counter()
            train_step(state)  # beside a replica restore's copy of what it fetched to the node's disk
            out["first_step_s"] = time.perf_counter() - t2
            out["to_first_step_s"] = time.time() - t0
    elif args.phase == "cost":
        out["save_cpu_s"], out["save_s"], out["threads_cpu_s"] = [], [], {}
        with stashpoint.CheckpointManager(node_root(args.base), node_local=True, replicas=args.replicas) as mgr:
            for step in range(1, 5):  # the first save allocates its buffers: not counted
                dist.barrier()
                u0, t, th0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), thread_cpu()
                mgr.save(step, state)
                mgr.wait()  # durable on every node, and with replicas, copied
                u1, th1 = resource.getrusage(resource.RUSAGE_SELF), thread_cpu()
                if step > 1:
                    out["save_cpu_s"].append(u1.ru_utime + u1.ru_stime - u0.ru_utime - u0.ru_stime)
                    for name, s in th1.items():  # summed over the saves counted
                        threads = out["threads_cpu_s"]
                        threads[name] = threads.get(name, 0.0) + s - th0.get(name, 0.0)
                    out["save_s"].append(time.perf_counter() - t)
                time.sleep(args.gap)
    else:
        times = []
        mgr = None
        if args.replicas >= 0:
            root = node_root(args.base)
            mgr = stashpoint.CheckpointManager(root, node_local=True, replicas=args.replicas, keep_last=2)
        for step in range(1, TRAIN_STEPS + 1):
            t = time.perf_counter()
            train_step(state)
            if mgr is not None and step in SAVES:
                mgr.save(step, state)
            times.append(time.perf_counter() - t)
        if mgr is not None:
            mgr.close()  # every save durable, its replicas sent and received
        out["step_s"] = times
        use = resource.getrusage(resource.RUSAGE_SELF)
        out["cpu_s"] = use.ru_utime + use.ru_stime  # the whole process: its training, saves and copies
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()
    os._exit(0)  # skip the gloo teardown at interpreter exit (tests/node_worker.py says why)


if __name__ == "__main__":
    main()
