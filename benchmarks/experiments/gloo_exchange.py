"""The floor of a replica's cost: two ranks send each other ``--mib`` MiB through gloo alone, in
16 MiB messages, both directions at once (a thread sends while the main thread receives), from
and into buffers reused across trials. Prints each rank's wall and CPU time (all its threads,
gloo's included) per trial. Run it alone: two cores serve both ranks.

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m benchmarks.experiments.gloo_exchange
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
import torch.distributed as dist

CHUNK = 16 << 20  # as stashpoint's transfers send


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    peer = 1 - rank
    out, into = torch.ones(CHUNK, dtype=torch.uint8), torch.empty(CHUNK, dtype=torch.uint8)
    count = (args.mib << 20) // CHUNK
    for _ in range(args.repeats):
        dist.barrier()
        cpu, wall = time.process_time(), time.perf_counter()

        def send() -> None:
            for _ in range(count):
                dist.send(out, peer, tag=1)

        sender = threading.Thread(target=send)
        sender.start()
        for _ in range(count):
            dist.recv(into, peer, tag=1)
        sender.join()
        print(
            f"rank {rank}: {args.mib} MiB each way in {time.perf_counter() - wall:.3f} s, "
            f"{time.process_time() - cpu:.3f} CPU s",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
