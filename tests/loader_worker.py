"""One rank of the data-loader tests (run by tests/dist_util.run_world as a real process).

    python loader_worker.py save|resume DIR

A torchdata ``StatefulDataLoader`` that shuffles with a generator of each rank's own seed.
``save``: two batches, a save of ``{"loader": it}``, then the next three batches (what a resume
must give). ``resume``: a fresh loader, loaded, then three batches (or the load's error).
Each rank prints ``RESULT {json}``.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

import stashpoint

RANK = int(os.environ["RANK"])


def loader() -> StatefulDataLoader:
    data = list(range(20))
    return StatefulDataLoader(data, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(100 + RANK))


def batches(it: object, n: int) -> list[list[int]]:
    return [next(it).tolist() for _ in range(n)]  # type: ignore[call-overload]


def main() -> None:
    phase, path = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    out: dict[str, object] = {"rank": RANK}
    try:
        dl = loader()
        if phase == "save":
            it = iter(dl)
            batches(it, 2)
            stashpoint.save({"loader": dl}, path)
            out["next"] = batches(it, 3)
        else:
            try:
                stashpoint.load({"loader": dl}, path)
            except stashpoint.CheckpointError as e:
                out["error"] = str(e)
            else:
                out["next"] = batches(iter(dl), 3)
    finally:
        print("RESULT " + json.dumps(out), flush=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
