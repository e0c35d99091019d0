"""Child processes for the manager tests (run as scripts).

python manager_child.py crash ROOT MB     # saves forever; prints "committed N" per commit
python manager_child.py memory ROOT MB N  # N saves; prints RSS and open fds along the way
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

import stashpoint


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    mode, root, mb = sys.argv[1], sys.argv[2], int(sys.argv[3])
    n = mb * 1024 * 1024 // 4
    state = {"w": torch.zeros(n), "b": torch.zeros(1000), "step": 0}

    def report(stats: stashpoint.SaveStats) -> None:
        print(f"committed {stats.step}", flush=True)

    if mode == "crash":
        mgr = stashpoint.CheckpointManager(root, keep_last=2, on_save=report)
        step = (mgr.latest_step() or 0) + 1
        while True:
            state["w"].fill_(step)
            state["b"].fill_(-step)
            state["step"] = step
            mgr.save(step, state)
            step += 1
    elif mode == "memory":
        total = int(sys.argv[4])
        with stashpoint.CheckpointManager(root, keep_last=2) as mgr:
            for step in range(1, total + 1):
                state["w"].fill_(step)
                mgr.save(step, state)
                if step in (20, total):
                    mgr.wait()
                    print(f"rss {step} {rss_bytes()} fds {open_fds()}", flush=True)


def open_fds() -> int:
    """The process's open descriptors, the least of a few looks 50 ms apart: the page-cache
    read-back of a committed save holds one for a moment on its own thread (not a leak)."""
    counts = []
    for _ in range(10):
        counts.append(len(list(Path("/proc/self/fd").iterdir())))
        time.sleep(0.05)
    return min(counts)


if __name__ == "__main__":
    main()
