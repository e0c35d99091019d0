"""One rank of a two-tier manager test (run by tests/dist_util.run_world as a real process).

    python tier_worker.py SCENARIO LOCAL REMOTE   (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment)

Prints one JSON line "RESULT {...}".
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import stashpoint

RANK = int(os.environ["RANK"])


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    shared = torch.randn(40_000, generator=g)  # the same on every rank: written once in total
    own = torch.full((1000,), float(step * 10 + RANK))  # this rank's own tensor
    return {"shared": shared, f"own{RANK}": own, "step": step}


def empty() -> dict:
    return {"shared": torch.zeros(40_000), f"own{RANK}": torch.zeros(1000), "step": -1}


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def main() -> None:
    scenario, local, remote = sys.argv[1:4]
    dist.init_process_group("gloo")
    out: dict = {}
    if scenario == "save":
        with stashpoint.CheckpointManager(local, keep_last=1, remote_root=remote, remote_keep_last=2) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, state(step))
                # training goes on: an all-reduce on the training's group between saves
                t = torch.ones(1)
                dist.all_reduce(t)
            mgr.wait()
            dist.barrier()  # rank 0 applies the retention: list once it is done
            out = {"local": mgr.steps(), "remote": mgr.remote_steps()}
    elif scenario == "single-root":  # no tiers: the manager's root itself is LOCAL (a path or s3:// URL)
        with stashpoint.CheckpointManager(local, keep_last=2) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, state(step))
            mgr.wait()
            dist.barrier()
            got = empty()
            out = {"steps": mgr.steps(), "step": mgr.restore(got), "ok": same(got, state(3))}
    elif scenario == "restore":
        # LOCAL may differ per rank ("{rank}" in it): a rank without a local copy forces the remote one
        with stashpoint.CheckpointManager(local.format(rank=RANK), remote_root=remote) as mgr:
            got = empty()
            step = mgr.restore(got)
            out = {"step": step, "ok": same(got, state(3)), "local": mgr.steps(), "tier": mgr.restored_from()}
    dist.barrier()
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # torch's gloo teardown can abort at exit; the result is out


if __name__ == "__main__":
    main()
