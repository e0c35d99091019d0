"""Training under a node-local CheckpointManager, for tests/test_nodelocal.py (issue 21).

    torchrun --nnodes 2 ... node_worker.py BASE STEPS --par ddp|fsdp2|hsdp [--every N] [--replicas K]
                                           [--remote DIR] [--digest]

Each node keeps its checkpoints in its own directory, ``BASE/node-<NODE_DIR>/ckpt`` (NODE_DIR
from the environment, default the node rank: a test may hand a node another's directory, or an
empty one). A transformers Llama from a small config under the given parallelism, AdamW, a
stateful sampler; resumes with ``restore`` (fresh model and optimizer), then trains to STEPS,
saving every N steps (and, with ``--remote``, uploading each step to DIR, the remote tier). Each
rank appends ``step loss`` lines to ``BASE/losses-<rank>.txt``, prints ``RESUMED <step>`` and
``REPORT <json>`` (its ``mgr.last_restore``), and ``WAIT_ERROR ...`` when ``mgr.wait()`` raised.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import stashpoint

sys.path.insert(0, str(Path(__file__).parent))
from stack_worker import build_model, dataset, loss_of, parallelize

torch.use_deterministic_algorithms(True)


def main() -> None:
    faulthandler.register(signal.SIGUSR1)  # a test that finds the job hung asks where it is
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("steps", type=int)
    ap.add_argument("--par", default="fsdp2")
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=0)
    ap.add_argument("--remote", default=None)
    ap.add_argument("--digest", action="store_true", help="print DIGEST lines of the state restored and at the end")
    ap.add_argument("--restore-step", type=int, default=None, help="restore this step alone; print why it failed")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    base = Path(args.base)
    node_dir = os.environ.get("NODE_DIR", os.environ.get("GROUP_RANK", "0"))
    torch.manual_seed(1234)  # a resume must not depend on the initialization
    model, blocks = build_model("llama")
    model, dp_rank, dp_size = parallelize(model, blocks, args.par, argparse.Namespace(ac=False))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = dataset("llama")
    sampler = stashpoint.StatefulSampler(data, seed=0, rank=dp_rank, world_size=dp_size)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler, generator=torch.Generator())
    state = {"model": model, "optim": optim, "sampler": sampler, "rng": stashpoint.RNGState()}
    opts = {"node_local": True, "replicas": args.replicas, "remote_root": args.remote}
    if args.restore_step is not None:
        with stashpoint.CheckpointManager(base / f"node-{node_dir}" / "ckpt", node_local=True) as mgr:
            try:
                mgr.restore(state, step=args.restore_step)
            except stashpoint.CheckpointError as e:
                say(f"RESTORE_ERROR {type(e).__name__}: {e}".replace("\n", " "))
        dist.destroy_process_group()
        os._exit(0)
    with stashpoint.CheckpointManager(base / f"node-{node_dir}" / "ckpt", keep_last=2, every_steps=args.every,
                                      **opts) as mgr:  # fmt: skip
        start = (mgr.restore(state) or 0) + 1
        say(f"RESUMED {start - 1}")
        report = mgr.last_restore
        if report is not None:
            doc = {"rank": rank, "step": report.step, "tier": report.tier, "order": report.order,
                   "passed_by": report.passed_by, "fetched": report.fetched,
                   "fetched_into": report.fetched_into}  # fmt: skip
            say("REPORT " + json.dumps(doc))
        if args.digest:
            say(f"DIGEST restored {start - 1} {digest(model, optim)}")
        batches = iter(loader)
        with (base / f"losses-{rank}.txt").open("a") as out:
            for step in range(start, args.steps + 1):
                try:
                    batch = next(batches)
                except StopIteration:
                    batches = iter(loader)
                    batch = next(batches)
                loss = loss_of("llama", model, batch)
                loss.backward()
                optim.step()
                optim.zero_grad()
                out.write(f"{step} {loss.item():.8f}\n")
                out.flush()
                mgr.maybe_save(step, state)
        try:
            mgr.wait()  # the uploads too: a test reads the remote tier next
        except stashpoint.CheckpointError as e:  # a test of a failure reads it here
            say(f"WAIT_ERROR {type(e).__name__}: {e}".replace("\n", " "))
        if args.digest:
            say(f"DIGEST final {args.steps} {digest(model, optim)}")
    dist.destroy_process_group()
    sys.stdout.flush()
    # DDP's reducer, freed at interpreter exit, joins the training group's gloo thread, which may
    # be waiting for the GIL the freeing thread holds (a torch teardown deadlock): skip teardown
    os._exit(0)


def say(line: str) -> None:
    """One line in one write: the ranks of an agent share its stdout, and print() writes the
    line and its end apart, so two ranks' lines could interleave."""
    sys.stdout.flush()
    os.write(1, (line + "\n").encode())


def digest(model: torch.nn.Module, optim: torch.optim.Optimizer) -> str:
    """A hash of the whole model and optimizer state, gathered (collective): the same on every
    rank, and the same for one state however many ranks hold it."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    h = hashlib.sha256()

    def walk(prefix: str, v: object) -> None:
        if isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(f"{prefix}/{k}", v[k])
        elif isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            h.update(f"{prefix}:{t.dtype}:{list(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{prefix}={v!r}".encode())

    walk("model", get_model_state_dict(model, options=opts))
    walk("optim", get_optimizer_state_dict(model, optim, options=opts).get("state", {}))
    return h.hexdigest()


if __name__ == "__main__":
    main()
