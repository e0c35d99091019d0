"""A small but real training job used by the exact-resume test (run as a script).

python resume_train.py straight OUT N     # 2N steps in one go; final state to OUT
python resume_train.py first CKPT N       # N steps, async_save, 3 more steps while it persists
python resume_train.py resume CKPT OUT N  # fresh process: load CKPT, N more steps; final state to OUT
"""

from __future__ import annotations

import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import stashpoint

VOCAB, SEQ, DIM = 64, 16, 32


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        layer = torch.nn.TransformerEncoderLayer(DIM, nhead=4, dim_feedforward=64, dropout=0.1, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.emb(x)))


def build():
    torch.manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (96, SEQ + 1), generator=torch.Generator().manual_seed(7))
    data = TensorDataset(tokens)
    model = TinyLM()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=3e-3, total_steps=100)
    sampler = stashpoint.StatefulSampler(data, seed=42)
    # its own generator: creating an iterator then draws no number from the global RNG
    loader = DataLoader(data, batch_size=8, sampler=sampler, drop_last=True, generator=torch.Generator())
    state = {
        "model": model,
        "optim": optim,
        "sched": sched,
        "sampler": sampler,
        "rng": stashpoint.RNGState(),
        "step": 0,
    }
    return state, loader


def batches(loader):
    while True:  # epochs follow each other; the sampler knows where it is
        yield from loader


def train(state, loader, n: int) -> None:
    model, optim, sched = state["model"], state["optim"], state["sched"]
    model.train()
    it = batches(loader)
    for _ in range(n):
        (seq,) = next(it)
        logits = model(seq[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
        loss.backward()
        optim.step()
        sched.step()
        optim.zero_grad()
        state["step"] += 1


def dump(state, out: str) -> None:
    torch.save(
        {
            "model": state["model"].state_dict(),
            "optim": state["optim"].state_dict(),
            "step": state["step"],
            "sched": state["sched"].state_dict(),
        },
        out,
    )


def main() -> None:
    torch.set_num_threads(2)
    mode = sys.argv[1]
    state, loader = build()
    if mode == "straight":
        out, n = sys.argv[2], int(sys.argv[3])
        train(state, loader, 2 * n)
        dump(state, out)
    elif mode == "first":
        ckpt, n = sys.argv[2], int(sys.argv[3])
        train(state, loader, n)
        handle = stashpoint.async_save(state, ckpt)
        train(state, loader, 3)  # training goes on while the save persists
        handle.wait()
    elif mode == "managed":
        root, out, n = sys.argv[2], sys.argv[3], int(sys.argv[4])
        stop_at = int(sys.argv[5]) if len(sys.argv) > 5 else 2 * n
        with stashpoint.CheckpointManager(root, keep_last=2, every_steps=5) as mgr:
            mgr.restore(state)
            while state["step"] < stop_at:
                train(state, loader, 1)
                mgr.maybe_save(state["step"], state)
        dump(state, out)
    elif mode == "resume":
        ckpt, out, n = sys.argv[2], sys.argv[3], int(sys.argv[4])
        stashpoint.load(state, ckpt)
        train(state, loader, n)
        dump(state, out)


if __name__ == "__main__":
    main()
