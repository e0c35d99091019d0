"""One rank of a small node-local job with replicas, for tests/test_replica_failures.py.

    replica_job.py BASE [--steps A:B] [--replicas K] [--keep N] [--remote DIR] [--timeout S] [--no-restore]

Started once per rank by the test (no torchrun: ``RANK``, ``WORLD_SIZE``, ``MASTER_*``,
``STASHPOINT_NODE``, ``STASHPOINT_LOCAL_RANK`` and ``NODE_DIR`` from the environment). The
state is a DTensor sharded over the ranks, each rank's shard filled with ``step * 1000 + rank``.
Restores (prints ``RESUMED <step> <value>``; not with ``--no-restore``), then saves the even steps in A..B, waiting for
each (``SAVED <step>`` or ``SAVE_ERROR <step> <error>``). With ``KILL_AT_REPLICA=<step>`` in its
environment, the rank kills itself (SIGKILL) as its node starts sending its replica of that step.
``--preempt-at S`` calls ``maybe_save`` every step instead (a save every second step, a 8 s
preemption deadline), rank 0 sending itself SIGTERM after step S; ``SLOW_REPLICA_FROM=<step>``
makes the replicas of that step and later ones take 30 s; ``LISTING_FAILS_AT=<step>`` makes
listing the files of that step to send raise a RuntimeError.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, init_device_mesh

import stashpoint
from stashpoint._dist import transfer


def say(line: str) -> None:
    os.write(1, (line.replace("\n", " ") + "\n").encode())


def kill_at_replica(step: int) -> None:
    send = transfer.send_step_files

    def sending(ctx, peer, at, t, save_id, **kw):  # type: ignore[no-untyped-def]
        if at.root.name == f"step-{step:08d}":
            time.sleep(0.3)  # the peers are inside the transfer too
            os.kill(os.getpid(), signal.SIGKILL)
        return send(ctx, peer, at, t, save_id, **kw)

    transfer.send_step_files = sending  # type: ignore[assignment]


def slow_replicas_from(step: int) -> None:
    send = transfer.send_step_files

    def sending(ctx, peer, at, t, save_id, **kw):  # type: ignore[no-untyped-def]
        if int(at.root.name.removeprefix("step-")) >= step:
            time.sleep(30)
        return send(ctx, peer, at, t, save_id, **kw)

    transfer.send_step_files = sending  # type: ignore[assignment]


def listing_fails_at(step: int) -> None:
    files_of = transfer._files_of

    def listing(at, *args, **kw):  # type: ignore[no-untyped-def]
        if at.root.name == f"step-{step:08d}":
            raise RuntimeError("a bug while listing the files to send")
        return files_of(at, *args, **kw)

    transfer._files_of = listing  # type: ignore[assignment]


def preempted(mgr: stashpoint.CheckpointManager, state: dict, rank: int, at: int) -> None:
    for s in range(1, 100):
        state["w"].to_local().fill_(s * 1000 + rank)
        state["step"] = s
        handle = mgr.maybe_save(s, state)
        if handle is not None:
            handle.wait()
        if s == at and rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("--steps", default="")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--remote", default=None)
    ap.add_argument("--timeout", type=float, default=None)
    ap.add_argument("--no-restore", action="store_true")
    ap.add_argument("--preempt-at", type=int, default=None)
    args = ap.parse_args()
    if "KILL_AT_REPLICA" in os.environ:
        kill_at_replica(int(os.environ["KILL_AT_REPLICA"]))
    if "LISTING_FAILS_AT" in os.environ:
        listing_fails_at(int(os.environ["LISTING_FAILS_AT"]))
    if "SLOW_REPLICA_FROM" in os.environ:
        slow_replicas_from(int(os.environ["SLOW_REPLICA_FROM"]))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    state = {"w": DTensor.from_local(torch.zeros(4096), mesh, [Shard(0)]), "step": 0}
    opts = {} if args.timeout is None else {"timeout": args.timeout}
    root = Path(args.base) / f"node-{os.environ['NODE_DIR']}"
    preemption = {} if args.preempt_at is None else {"preemption_deadline": 8.0, "every_steps": 2}
    with stashpoint.CheckpointManager(
        root, node_local=True, replicas=args.replicas, keep_last=args.keep, remote_root=args.remote, **preemption
    ) as mgr:
        if args.preempt_at is not None:
            preempted(mgr, state, rank, args.preempt_at)
        if not args.no_restore:
            try:
                got = mgr.restore(state, **opts)
            except stashpoint.CheckpointError as e:
                say(f"RESTORE_ERROR {type(e).__name__}: {e}")
                got = None
            say(f"RESUMED {got} {state['w'].to_local()[0].item():.0f}")
        if args.steps:
            lo, hi = map(int, args.steps.split(":"))
            for s in range(lo, hi + 1, 2):
                state["w"].to_local().fill_(s * 1000 + rank)
                state["step"] = s
                try:
                    mgr.save(s, state, **opts)
                    mgr.wait()
                    say(f"SAVED {s}")
                except stashpoint.CheckpointError as e:
                    say(f"SAVE_ERROR {s} {type(e).__name__}: {e}")
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
