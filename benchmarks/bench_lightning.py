"""Lightning's checkpointing against stashpoint's plugin on the same run (issue 20).

    python -m benchmarks.bench_lightning [--width 2048] [--layers 4] [--steps 40] [--every 10] [--repeat 2]
                                         [--save-last]

One ``Trainer.fit`` per method, the same model (``--layers`` Linear(width, width) layers; with
AdamW's two moments the checkpoint is ~12 bytes per parameter), data and schedule: a
``ModelCheckpoint`` saving every ``--every`` steps (``save_top_k=-1``), and a run without
checkpoints as the baseline. Per method, over ``--repeat`` runs (the best of each):

- **blocked per save**: the time ``save_checkpoint`` held the training loop (median and the
  longest call; with ``--save-last`` ``ModelCheckpoint`` also saves ``last.ckpt`` after each
  checkpoint, two calls back to back);
- **lost per save**: (fit time - the baseline's fit time) / saves: what training really lost,
  background writes' contention included; every save is durable (or, for ``torch.save``,
  written: it does not fsync) when ``fit`` returns.

Methods: Lightning's default ``TorchCheckpointIO`` (``torch.save`` in the loop), its
``AsyncCheckpointIO`` (a thread, after cloning every tensor), and ``StashpointCheckpointIO``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch.utils.data import DataLoader, TensorDataset

from stashpoint.integrations.lightning import StashpointCheckpointIO


class Timed(CheckpointIO):
    """Forwards to ``inner`` and records how long each ``save_checkpoint`` call held the caller."""

    def __init__(self, inner: CheckpointIO) -> None:
        self.inner = inner
        self.blocked: list[float] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        t0 = time.perf_counter()
        self.inner.save_checkpoint(checkpoint, path, storage_options)
        self.blocked.append(time.perf_counter() - t0)

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        return self.inner.load_checkpoint(path, map_location)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


class Net(L.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def fit(method: str, args: argparse.Namespace, root: Path) -> tuple[float, list[float]]:
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(args.steps * 4, args.width)), batch_size=4)
    io: Timed | None = None
    callbacks: list[Any] = []
    if method != "none":
        inner: CheckpointIO = {
            "torch.save": TorchCheckpointIO,
            "AsyncCheckpointIO": lambda: AsyncCheckpointIO(TorchCheckpointIO()),
            "stashpoint": StashpointCheckpointIO,
        }[method]()
        io = Timed(inner)
        callbacks = [
            ModelCheckpoint(
                dirpath=root / method, every_n_train_steps=args.every, save_top_k=-1, save_last=args.save_last
            )
        ]
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        plugins=[io] if io is not None else None,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
    )
    model = Net(args.width, args.layers)
    t0 = time.perf_counter()
    trainer.fit(model, data)
    took = time.perf_counter() - t0
    shutil.rmtree(root / method, ignore_errors=True)
    return took, io.blocked if io is not None else []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--save-last", action="store_true", help="ModelCheckpoint(save_last=True)")
    args = ap.parse_args()
    params = args.layers * (args.width * args.width + args.width)
    methods = ["none", "torch.save", "AsyncCheckpointIO", "stashpoint"]
    best: dict[str, tuple[float, list[float]]] = {}
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        for _ in range(args.repeat):  # interleaved, so that the machine's drift touches every method alike
            for m in methods:
                took, blocked = fit(m, args, Path(tmp))
                if m not in best or took < best[m][0]:
                    best[m] = (took, blocked)
    saves = args.steps // args.every
    base = best["none"][0]
    print(
        f"{params / 1e6:.1f} M parameters, checkpoint ~{params * 12 / 1e6:.0f} MB (weights + AdamW), "
        f"{args.steps} steps, a save every {args.every} ({saves} saves"
        f"{', each with last.ckpt' if args.save_last else ''}); best of {args.repeat}"
    )
    print("| method | fit time | blocked per call (median / longest) | lost per save | vs stashpoint (lost) |")
    print("|---|---:|---:|---:|---:|")
    lost = {m: max(0.0, (best[m][0] - base) / saves) for m in methods[1:]}
    for m in methods:
        took, blocked = best[m]
        if m == "none":
            print(f"| no checkpoints | {took:.2f} s | - | - | - |")
            continue
        med = sorted(blocked)[len(blocked) // 2] if blocked else 0.0
        top = max(blocked, default=0.0)
        ratio = lost[m] / lost["stashpoint"] if lost["stashpoint"] > 0 else float("inf")
        calls = f"{med * 1000:.0f} / {top * 1000:.0f} ms"
        print(f"| {m} | {took:.2f} s | {calls} | {lost[m] * 1000:.0f} ms | {ratio:.1f}x |")


if __name__ == "__main__":
    main()
