"""Worker of test_groups_kept.py: a rank of a real gloo world opening and closing managers.

Prints one JSON line "RESULT {...}"."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

import stashpoint


def _groups() -> int:
    return len(distributed_c10d._world.pg_map)  # every process group torch holds in this process


def main() -> None:
    base = sys.argv[1]
    dist.init_process_group("gloo")
    state = {"w": torch.arange(8.0)}
    before = _groups()
    for i in range(4):  # one after another, as an evaluation loop or a notebook does
        with stashpoint.CheckpointManager(
            f"{base}/local{i}", remote_root=f"{base}/remote{i}", preemption_deadline=30, every_steps=1
        ) as mgr:
            mgr.maybe_save(1, state)
            mgr.wait()
    cycled = _groups() - before
    # stashpoint.shutdown() while a manager is open: its groups are made anew when next used
    with stashpoint.CheckpointManager(
        f"{base}/local", remote_root=f"{base}/remote", keep_last=1, preemption_deadline=30, every_steps=1
    ) as mgr:
        mgr.maybe_save(1, state)
        mgr.wait()
        stashpoint.shutdown()
        for step in (2, 3):
            state["w"] += 1
            mgr.maybe_save(step, state)
            mgr.wait()
        dist.barrier()  # rank 0 applies the retention: list once it is done
        steps, remote = mgr.steps(), mgr.remote_steps()
    stashpoint.shutdown()
    out = {"cycled": cycled, "after_shutdown": _groups() - before, "local": steps, "remote": remote}
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
