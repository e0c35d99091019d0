"""The per-tensor cost of an async_save call on many small FSDP2 DTensors (2 ranks, gloo, CPU).

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m benchmarks.experiments.bench_dtensor_call \
        [--layers 200] [--optim adamw|subclass]

200 FSDP2-sharded Linear(256, 256) layers with AdamW: 1,600 DTensors of ~10 MB in all, so the
copy is negligible and the call's blocking time is the per-tensor work (state dict, layout,
planning). ``--optim subclass`` takes a subclass of AdamW defined here, an optimizer of one's
own to stashpoint (whose state is checked for plain tensors shaped like a rank's shard, where
torch's own optimizers are not). Prints rank 0's blocking times of 5 calls after a warm-up save.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import stashpoint


class _OwnAdamW(torch.optim.AdamW):
    """AdamW under another module's name: an optimizer of one's own."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--optim", choices=("adamw", "subclass"), default="adamw")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 256) for _ in range(args.layers)]
    model = torch.nn.Sequential(*layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = (_OwnAdamW if args.optim == "subclass" else torch.optim.AdamW)(model.parameters(), lr=1e-3)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    state = {"model": model, "optim": opt}
    root = tempfile.mkdtemp(prefix="stashpoint-dtensor-") if dist.get_rank() == 0 else ""
    box = [root]
    dist.broadcast_object_list(box)
    root = box[0]
    stashpoint.save(state, f"{root}/warm")
    times = []
    for i in range(5):
        dist.barrier()
        t = time.perf_counter()
        handle = stashpoint.async_save(state, f"{root}/ck{i}")
        times.append(time.perf_counter() - t)
        handle.wait()
    if dist.get_rank() == 0:
        n = sum(1 for _ in model.parameters()) * 3
        print(
            f"{args.optim}: {n} DTensors per rank; async_save blocking ms: {[round(x * 1e3, 1) for x in times]}; "
            f"median {statistics.median(times) * 1e3:.1f} ms"
        )
    dist.barrier()
    if dist.get_rank() == 0:  # six checkpoints of the state: 7 GB at --layers 1500
        shutil.rmtree(root, ignore_errors=True)
    os._exit(0)  # gloo's teardown at interpreter exit can abort (a torch issue); the figures are out


if __name__ == "__main__":
    main()
