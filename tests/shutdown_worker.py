"""A training-like program that ends normally: saves on two gloo ranks (thread and process
writers, one still persisting at the end), then ``stashpoint.shutdown()`` and the training's
own ``destroy_process_group()``, and returns from main with no ``os._exit``. Saves and loads
after a shutdown create a fresh group, which the next shutdown ends.

    python shutdown_worker.py OUT_DIR     # under tests/dist_util.run_world
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import stashpoint
from stashpoint._save import writerproc


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optim.step()
    state = {"model": model, "optim": optim}
    stashpoint.save(state, f"{out}/a")
    stashpoint.async_save(state, f"{out}/b", writer="process").wait()
    pid = writerproc.current_pid()
    last = stashpoint.async_save(state, f"{out}/c")  # still persisting when shutdown() is called
    stashpoint.shutdown()
    done = last.done()
    again = []
    for value, name in enumerate(("d", "e"), start=1):  # each a fresh group (a notebook's second fit())
        stashpoint.save({"w": torch.full((4,), float(value))}, f"{out}/{name}")
        back = {"w": torch.zeros(4)}
        stashpoint.load(back, f"{out}/{name}")
        again.append(back["w"].tolist())
        stashpoint.shutdown()
    stashpoint.shutdown()  # twice in a row is harmless
    dist.barrier()  # the training's own group still works
    dist.destroy_process_group()
    print("RESULT " + json.dumps({"rank": rank, "writer_pid": pid, "last_done": done, "again": again}))


if __name__ == "__main__":
    main()
