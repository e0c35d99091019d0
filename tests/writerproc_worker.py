"""One rank of the two-rank writer-process test (run by tests/test_writer_process.py as a real process).

    python writerproc_worker.py PATH   (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment)

Each rank holds a replicated model and optimizer plus a tensor of its own, saves twice with
``writer="process"`` (the second save over the first), loads the checkpoint into fresh objects
and compares it bit for bit. Prints one ``RESULT {...}`` JSON line: the figures of both saves,
the writer process's pid around each save, and whether everything came back.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import stashpoint
from stashpoint._save import writerproc as _writerproc

RANK = int(os.environ["RANK"])


def make_state(seed: int) -> dict:
    torch.manual_seed(seed)  # the same on every rank: replicated
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 64)).pow(2).mean().backward()
    optim.step()
    own = torch.arange(100_000, dtype=torch.float64) * (RANK + 1) + seed  # this rank's only: its own key
    return {"model": model, "optim": optim, f"own{RANK}": own, "step": seed}


def same(a: dict, b: dict) -> bool:
    sa, sb = a["model"].state_dict(), b["model"].state_dict()
    oa, ob = a["optim"].state_dict()["state"], b["optim"].state_dict()["state"]
    return (
        all(torch.equal(sa[k], sb[k]) for k in sa)
        and all(torch.equal(oa[i][n], ob[i][n]) for i in oa for n in oa[i])
        and torch.equal(a[f"own{RANK}"], b[f"own{RANK}"])
        and a["step"] == b["step"]
    )


def main() -> None:
    path = sys.argv[1]
    dist.init_process_group("gloo")
    first = stashpoint.save(make_state(1), path, writer="process", timeout=60)
    pid_first = _writerproc.current_pid()
    state = make_state(2)
    second = stashpoint.save(state, path, writer="process", overwrite=True, timeout=60)
    pid_second = _writerproc.current_pid()
    dist.barrier()
    fresh = make_state(3)
    stashpoint.load(fresh, path)
    print(
        "RESULT "
        + json.dumps(
            {
                "same": same(fresh, state),
                "writers": [first.writer, second.writer],
                "pids": [pid_first, pid_second],
                "rank_bytes": [first.rank_bytes_written, second.rank_bytes_written],
                "bytes": second.bytes_written,
            }
        ),
        flush=True,
    )
    dist.barrier()
    os._exit(0)  # see dist_worker.py: skip the gloo teardown (the writer process sees its parent go)


if __name__ == "__main__":
    main()
