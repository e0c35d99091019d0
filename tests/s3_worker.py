"""One rank of a multi-process S3 test (run by ``dist_util.run_world(..., worker=S3_WORKER)``).

    python s3_worker.py save URL EXPECTED.pt   # save a model + AdamW + a Shard(0) DTensor to URL
    python s3_worker.py load URL EXPECTED.pt   # load it back as a Shard(1) DTensor, compare

The AWS_* variables of the test's SeaweedFS server come from the environment. Each scenario
prints one JSON line "RESULT {...}".
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import stashpoint

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])


def result(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def full_tensor() -> torch.Tensor:
    return torch.randn(13, 7, generator=torch.Generator().manual_seed(5))


def trained_state(placement) -> dict:
    """The same model and optimizer on every rank (replicated, as with DDP) and one sharded tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        model(torch.randn(4, 16, generator=g)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    mesh = init_device_mesh("cpu", (WORLD,))
    return {"model": model, "optim": optim, "sharded": distribute_tensor(full_tensor(), mesh, [placement]), "step": 7}


def main() -> None:
    from torch.distributed.tensor import Shard

    scenario, url, expected_path = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    try:
        if scenario == "save":
            state = trained_state(Shard(0))
            stats = stashpoint.save(state, url)
            if RANK == 0:
                expected = {"model": state["model"].state_dict(), "optim": state["optim"].state_dict()}
                torch.save(expected, expected_path)
            result(bytes=stats.rank_bytes_written)
        elif scenario == "load":
            torch.manual_seed(123)  # other initial values: the load must overwrite them all
            model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import distribute_tensor

            mesh = init_device_mesh("cpu", (WORLD,))
            sharded = distribute_tensor(torch.zeros(13, 7), mesh, [Shard(1)])
            state = {"model": model, "sharded": sharded, "step": 0}
            stashpoint.load(state, url, strict=False)  # the optimizer is not loaded here
            expected = torch.load(expected_path, weights_only=True)
            same_model = all(torch.equal(v, expected["model"][k]) for k, v in model.state_dict().items())
            same_shard = torch.equal(state["sharded"].full_tensor(), full_tensor())
            result(same_model=same_model, same_shard=same_shard, step=state["step"])
        else:
            raise SystemExit(f"unknown scenario {scenario!r}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
