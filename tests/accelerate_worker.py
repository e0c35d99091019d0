"""A small Hugging Face Accelerate training run for tests/test_accelerate.py.

    python accelerate_worker.py DIR STEPS [--every K] [--resume-from PATH | --manager [--resume]] [--slow S]

Trains a two-layer GPT-2 (transformers, dropout on) on fixed random tokens with a shuffled
(seedable, stateful) dataloader, AdamW and a warm-up schedule, prepared by a real
``Accelerator`` on the CPU (one process, or every process of a torchrun launch). Every K steps
it saves with :func:`stashpoint.integrations.accelerate.save_state` to ``DIR/ckpts/step-NNNN``
(or, with ``--manager``, through a ``CheckpointManager`` on ``DIR/ckpts`` keeping two steps).
``--resume-from PATH`` loads a checkpoint first (``load_state``); ``--manager --resume`` restores
the newest committed step. Appends ``{"step": s, "loss": x}`` per step to
``DIR/losses-<rank>.jsonl``; writes ``DIR/done-<rank>.json`` at the end.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

import stashpoint
from stashpoint.integrations.accelerate import accelerator_state, load_state, save_state


class Tally:
    """An object registered for checkpointing: the tokens seen so far."""

    def __init__(self) -> None:
        self.tokens = 0

    def state_dict(self) -> dict[str, int]:
        return {"tokens": self.tokens}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.tokens = int(sd["tokens"])


def build(seed: int = 0, stateful: bool = True) -> tuple[Accelerator, Any, Any, Any, DataLoader, Tally]:
    acc = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, use_stateful_dataloader=stateful)
    )
    set_seed(seed)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=97, n_positions=16, bos_token_id=0, eos_token_id=0)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    tokens = torch.randint(0, 97, (40, 16), generator=torch.Generator().manual_seed(1))
    # its own generator: a new iterator (after a resume, mid-epoch) must not draw from the global one
    loader = DataLoader(TensorDataset(tokens), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2))
    tally = Tally()
    acc.register_for_checkpointing(tally)
    model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    return acc, model, opt, sched, loader, tally


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("steps", type=int)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--resume-from")
    ap.add_argument("--manager", action="store_true")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--slow", type=float, default=0.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # one reduction order, in a test's process as in a launched one
    out = Path(args.dir)
    acc, model, opt, sched, loader, tally = build()
    log = out / f"losses-{acc.process_index}.jsonl"
    mgr = stashpoint.CheckpointManager(out / "ckpts", keep_last=2) if args.manager else None
    step = 0
    if args.resume_from:
        load_state(acc, args.resume_from)
        step = int(args.resume_from.rsplit("-", 1)[1])
    elif mgr is not None and args.resume:
        step = mgr.restore(accelerator_state(acc)) or 0
    handle = None
    model.train()
    while step < args.steps:
        for (batch,) in loader:
            step += 1
            loss = model(input_ids=batch, labels=batch).loss
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            tally.tokens += batch.numel()
            with log.open("a") as f:
                f.write(json.dumps({"step": step, "loss": loss.item(), "batch": int(batch.sum())}) + "\n")
            if step % args.every == 0:
                if mgr is not None:
                    mgr.save(step, accelerator_state(acc))
                else:
                    handle = save_state(acc, out / "ckpts" / f"step-{step:04d}")
            time.sleep(args.slow)
            if step >= args.steps:
                break
    if mgr is not None:
        mgr.close()
    elif handle is not None:
        handle.wait()
    done = {"step": acc.step, "iteration": acc.save_iteration, "tokens": tally.tokens, "epoch": loader.iteration}
    (out / f"done-{acc.process_index}.json").write_text(json.dumps(done))
    acc.end_training()


if __name__ == "__main__":
    main()
