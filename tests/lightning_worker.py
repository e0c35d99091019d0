"""A small Lightning training run for tests/test_lightning.py.

    python lightning_worker.py DIR EPOCHS [--resume] [--ddp] [--slow S] [--plain-io]

Trains a tiny regression model on fixed data (no shuffling, seeded; deterministic on the CPU) with a ``ModelCheckpoint``
saving ``last`` and the best two by ``train_loss`` at every epoch's end through
``StashpointCheckpointIO``, and appends ``{"step": s, "loss": x}`` per training step to
``DIR/losses-<rank>.jsonl``. ``--resume`` continues from ``last`` (``ckpt_path="last"``);
``--slow S`` sleeps S seconds per step (so a test can kill it mid-fit).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from stashpoint.integrations.lightning import StashpointCheckpointIO


class Model(L.LightningModule):
    def __init__(self, width: int = 16, note: str = "tiny") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
        self.out: Path | None = None
        self.slow = 0.0

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        if self.out is not None:
            with self.out.open("a") as f:
                f.write(json.dumps({"step": self.global_step, "loss": loss.item()}) + "\n")
        if self.slow:
            time.sleep(self.slow)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(64, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("epochs", type=int)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--ddp", action="store_true")
    ap.add_argument("--slow", type=float, default=0.0)
    args = ap.parse_args(argv)
    d = Path(args.dir)
    L.seed_everything(0, workers=True)
    model = Model()
    model.slow = args.slow
    ckpt = ModelCheckpoint(dirpath=d / "ckpts", monitor="train_loss", mode="min", save_top_k=2, save_last=True)
    trainer = L.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=2 if args.ddp else 1,
        strategy="ddp" if args.ddp else "auto",
        plugins=[StashpointCheckpointIO()],
        callbacks=[ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model.out = d / f"losses-{trainer.global_rank}.jsonl"
    trainer.fit(model, data(), ckpt_path="last" if args.resume else None)
    if trainer.global_rank == 0:
        (d / "done.json").write_text(json.dumps({"global_step": trainer.global_step, "best": ckpt.best_model_path}))


if __name__ == "__main__":
    main()
