"""One rank of the two-rank overlap test (run by tests/test_overlap.py as a real process).

    python overlap_worker.py PATH   (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment)

Trains a DDP model (BatchNorm, SGD with momentum), a plain tensor and a parameter outside the
optimizer; saves with ``overlap=True`` while the background copies are held back for a while;
trains on; then loads the checkpoint into fresh objects and compares it, bit for bit, with a deep
copy of the state taken at the moment of the call. Prints one ``RESULT {...}`` JSON line.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import stashpoint
from stashpoint._save import overlap as _overlap

RANK = int(os.environ["RANK"])
HOLD_S = 0.5  # the background copies start this long after the call


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 256)
        self.bn = torch.nn.BatchNorm1d(256)
        self.fc2 = torch.nn.Linear(256, 8)
        self.gain = torch.nn.Parameter(torch.ones(8), requires_grad=False)  # in no optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x)))) * self.gain


def snapshot(state: dict) -> dict:
    return copy.deepcopy(
        {
            "model": state["model"].module.state_dict(),
            "optim": state["optim"].state_dict(),
            "ema": state["ema"],
            "step": state["step"],
        }
    )


def step(state: dict, i: int) -> None:
    torch.manual_seed(1000 + i)  # the same batch on every rank: replicated state stays identical
    ddp, optim = state["model"], state["optim"]
    ddp(torch.randn(32, 64)).pow(2).mean().backward()
    with torch.no_grad():
        ddp.module.gain.mul_(0.99)  # changed in place outside the optimizer: copied eagerly
        state["ema"].mul_(0.9).add_(1.0)
    optim.step()
    optim.zero_grad()
    state["step"] += 1


def same_bits(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1), b.reshape(-1))
    if isinstance(a, dict):
        assert isinstance(b, dict)
        return a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple))
        return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    return a == b


def main() -> None:
    path = sys.argv[1]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = Net()
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    optim = torch.optim.SGD(
        list(net.fc1.parameters()) + list(net.bn.parameters()) + list(net.fc2.parameters()), lr=0.05, momentum=0.9
    )
    state = {"model": ddp, "optim": optim, "ema": torch.zeros(1000), "step": 0}
    for i in range(3):
        step(state, i)

    copies = _overlap.copy_deferred

    def held(triples):  # fault injection: the background copies start late
        time.sleep(HOLD_S)
        copies(triples)

    _overlap.copy_deferred = held
    ref = snapshot(state)
    handle = stashpoint.async_save(state, path, overlap=True, timeout=60)
    staged_at_call = handle.staged()
    t0 = time.perf_counter()
    step(state, 3)  # this step's optimizer.step() must wait for the copies
    first_step_s = time.perf_counter() - t0
    staged_after_step = handle.staged()
    for i in range(4, 7):
        step(state, i)
    stats = handle.wait()
    hooks_left = len(optim._optimizer_step_pre_hooks)
    changed = not same_bits(snapshot(state), ref)
    dist.barrier()

    torch.manual_seed(7)
    net2 = Net()
    optim2 = torch.optim.SGD(
        list(net2.fc1.parameters()) + list(net2.bn.parameters()) + list(net2.fc2.parameters()), lr=0.05, momentum=0.9
    )
    fresh = {"model": net2, "optim": optim2, "ema": torch.full((1000,), -1.0), "step": -1}
    stashpoint.load(fresh, path)
    got = copy.deepcopy(
        {"model": net2.state_dict(), "optim": optim2.state_dict(), "ema": fresh["ema"], "step": fresh["step"]}
    )
    print(
        "RESULT "
        + json.dumps(
            {
                "same": same_bits(got, ref),
                "changed": changed,
                "staged_at_call": staged_at_call,
                "staged_after_step": staged_after_step,
                "first_step_s": first_step_s,
                "step_wait_s": stats.step_wait_s,
                "hooks_left": hooks_left,
            }
        ),
        flush=True,
    )
    dist.barrier()
    os._exit(0)  # see dist_worker.py: skip the gloo teardown


if __name__ == "__main__":
    main()
