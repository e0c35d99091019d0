"""The training side of ``stashpoint demo``: the model, the data, and the child process that
trains and checkpoints (``python -m stashpoint._tools.demo_train child '<json config>'``, started by
the demo's parent, which does all the printing from the JSON events the child sends)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import stashpoint
from stashpoint._core.naming import LOCK_NAME, parse_step_dir, step_dir
from stashpoint._manager.lock import acquire_root_lock, release_root_lock
from stashpoint.errors import CheckpointError

MANIFEST = "manifest.json"
KEEP_LAST = 3
LOG_KILLED = "phase1-killed.jsonl"
LOG_RESUMED = "phase2-resumed.jsonl"
BASELINE_FILE = ".torch-save-baseline.pt"
_DEMO_LOGS = {LOG_KILLED, LOG_RESUMED, BASELINE_FILE}  # written by the demo alone
_DEMO_FILES = {*_DEMO_LOGS, LOCK_NAME}
_EVENT = "@stashpoint-demo "  # prefix of the children's event lines on stdout
THREADS = 1  # the same in every run: CPU results are bitwise reproducible for a fixed thread count
SEED = 1234
STALL_S = 120.0  # the parent gives up on a child that reports nothing for this long


@dataclass(frozen=True)
class Preset:
    """The size of the model, the data and the run."""

    vocab: int
    d_model: int
    heads: int
    layers: int
    d_ff: int
    seq_len: int
    batch: int
    samples: int
    lr: float
    warmup: int
    kill_after: int  # checkpoints written before the kill
    every: int | None  # default checkpoint interval; None: chosen from the time budget


PRESETS = {
    "full": Preset(
        vocab=1000,
        d_model=256,
        heads=4,
        layers=4,
        d_ff=1024,
        seq_len=64,
        batch=8,
        samples=2048,
        lr=1e-3,
        warmup=20,
        kill_after=4,
        every=None,
    ),
    "quick": Preset(
        vocab=1000,
        d_model=64,
        heads=2,
        layers=2,
        d_ff=128,
        seq_len=32,
        batch=8,
        samples=64,
        lr=3e-3,
        warmup=5,
        kill_after=2,
        every=5,
    ),
}


# ------------------------------------------------------------------------------------------------
# model and data


class TinyLM(nn.Module):
    """A causal transformer language model: token + position embeddings, pre-norm encoder layers,
    output head tied to the token embedding."""

    def __init__(self, p: Preset) -> None:
        super().__init__()
        self.tok = nn.Embedding(p.vocab, p.d_model)
        self.pos = nn.Embedding(p.seq_len, p.d_model)
        layer = nn.TransformerEncoderLayer(p.d_model, p.heads, p.d_ff, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, p.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(p.d_model)
        self.head = nn.Linear(p.d_model, p.vocab, bias=False)
        self.head.weight = self.tok.weight
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)
        self.causal_mask: torch.Tensor
        self.register_buffer("causal_mask", nn.Transformer.generate_square_subsequent_mask(p.seq_len), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        h = self.tok(x) + self.pos.weight[:n]
        h = self.encoder(h, mask=self.causal_mask[:n, :n], is_causal=True)
        out: torch.Tensor = self.head(self.norm(h))
        return out


def synthetic_tokens(p: Preset, seed: int = SEED) -> torch.Tensor:
    """``samples`` sequences of ``seq_len + 1`` tokens from a seeded random Markov chain: each token
    has four likely successors, so there is something to learn (the best loss is about 1.1)."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, p.vocab, (p.vocab, 4), generator=g)
    probs = torch.tensor([0.55, 0.25, 0.15, 0.05]).expand(p.samples, 4)
    seq = torch.empty(p.samples, p.seq_len + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, p.vocab, (p.samples,), generator=g)
    for t in range(p.seq_len):
        pick = torch.multinomial(probs, 1, generator=g).squeeze(1)
        seq[:, t + 1] = successors[seq[:, t], pick]
    return seq


class TokenDataset(Dataset[torch.Tensor]):
    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


# ------------------------------------------------------------------------------------------------
# checkpoints on disk


def ckpt_name(step: int) -> str:
    return step_dir(step)


def list_checkpoints(directory: Path) -> list[tuple[int, Path, bool]]:
    """``(step, path, committed)`` for every ``step-*`` directory, oldest first."""
    found = []
    if directory.is_dir():
        for p in directory.iterdir():
            step = parse_step_dir(p.name)
            if step is not None and p.is_dir():
                found.append((step, p, (p / MANIFEST).is_file()))
    return sorted(found)


def latest_committed(directory: Path) -> tuple[int, Path] | None:
    """The newest checkpoint whose save committed (one without a manifest never finished)."""
    committed = [(s, p) for s, p, ok in list_checkpoints(directory) if ok]
    return committed[-1] if committed else None


def prepare_dir(directory: Path) -> None:
    """Create the demo directory, or empty it if it holds only what an earlier demo left there.

    Raises ``ValueError`` (with a message for the user) for anything else.
    """
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{directory} is a file; pass a directory for the demo with --dir")
    if directory.is_dir():
        entries = sorted(directory.iterdir())
        ours = {e.name for e in entries if e.name in _DEMO_FILES or (parse_step_dir(e.name) is not None and e.is_dir())}
        foreign = [e.name for e in entries if e.name not in ours]
        # a run's own directory holds step-* and the lock too: only a demo's logs make it the demo's
        if entries and not ours & _DEMO_LOGS:
            foreign = foreign or [e.name for e in entries]
        if foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise ValueError(
                f"{directory} is not empty and does not look like a stashpoint demo directory (it holds "
                f"{shown}, and no log of an earlier demo); the demo clears its directory first, so pass a new "
                "or empty one with --dir"
            )
        try:  # an earlier demo still running there keeps its manager's lock
            if LOCK_NAME in ours:
                release_root_lock(acquire_root_lock(directory))
        except CheckpointError as busy:
            raise ValueError(f"{directory} is in use: {busy}") from None
        for e in entries:
            if e.is_dir():
                shutil.rmtree(e)
            else:
                e.unlink()
    directory.mkdir(parents=True, exist_ok=True)


def read_log(path: Path) -> dict[int, str]:
    """``step -> loss.hex()`` from a run's log (a line cut short by the kill is skipped)."""
    losses: dict[int, str] = {}
    if not path.exists():
        return losses
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "loss" in rec and "step" in rec:
            losses[int(rec["step"])] = str(rec["loss"])
    return losses


# ------------------------------------------------------------------------------------------------
# the training child


@dataclass(frozen=True)
class ChildConfig:
    directory: str
    log: str
    preset: str
    every: int | None  # None: choose from the time budget after timing a few steps
    resume: bool
    stop_step: int | None  # train through this step, then exit (None: until killed)
    budget_s: float  # the whole demo's time budget, used to choose ``every``
    launched_at: float  # time.time() when the parent started the demo
    max_s: float  # a safety limit: exit after this long even if nobody kills us


def _emit(event: str, **fields: Any) -> None:
    print(_EVENT + json.dumps({"event": event, **fields}), flush=True)


def _nice_interval(k: float) -> int:
    k = max(4, int(k))
    if k >= 100:
        return k // 50 * 50
    if k >= 20:
        return k // 10 * 10
    if k >= 10:
        return k // 5 * 5
    return k


def _torch_save_fsync(state: dict[str, Any], path: Path) -> float:
    """Seconds a plain ``torch.save`` of the same state, made durable with fsync, takes."""
    t0 = time.perf_counter()
    plain = {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()}
    with path.open("wb") as f:
        torch.save(plain, f)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - t0
    path.unlink()
    return elapsed


def train(cfg: ChildConfig) -> int:
    """Train (from scratch, or from the latest committed checkpoint) and report through events."""
    t_start = time.perf_counter()
    torch.set_num_threads(THREADS)
    torch.manual_seed(SEED)
    p = PRESETS[cfg.preset]
    directory = Path(cfg.directory)

    data = TokenDataset(synthetic_tokens(p))
    model = TinyLM(p)
    optim = torch.optim.AdamW(model.parameters(), lr=p.lr, weight_decay=0.01)
    warmup = torch.optim.lr_scheduler.LinearLR(optim, start_factor=0.05, total_iters=p.warmup)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=2000, eta_min=p.lr / 10)
    sched = torch.optim.lr_scheduler.SequentialLR(optim, [warmup, cosine], milestones=[p.warmup])
    sampler = stashpoint.StatefulSampler(data, seed=SEED)
    # The DataLoader draws a seed for its workers each time an iterator starts; give it its own
    # generator so that this does not consume the global RNG (which dropout uses): a run resumed
    # mid-epoch starts an iterator where the original run did not.
    loader = DataLoader(data, batch_size=p.batch, sampler=sampler, generator=torch.Generator().manual_seed(SEED))
    state: dict[str, Any] = {
        "model": model,
        "optim": optim,
        "sched": sched,
        "rng": stashpoint.RNGState(),
        "sampler": sampler,
        "step": 0,
    }
    n_params = sum(t.numel() for t in model.parameters())
    _emit("ready", params=n_params, threads=torch.get_num_threads())

    # The manager owns the run directory: step-XXXXXXXX directories, the newest KEEP_LAST kept,
    # and (on opening) the removal of directories left by a save that never committed.
    with stashpoint.CheckpointManager(directory, keep_last=KEEP_LAST) as mgr:
        if cfg.resume:
            t0 = time.perf_counter()
            resumed = mgr.restore(state)
            if resumed is None:
                _emit("error", message=f"no committed checkpoint in {directory}")
                return 1
            _emit("resumed", path=ckpt_name(resumed), step=state["step"], load_ms=(time.perf_counter() - t0) * 1e3)
        return _train_loop(cfg, p, state, loader, mgr, t_start)


def _train_loop(  # noqa: PLR0917
    cfg: ChildConfig,
    p: Preset,
    state: dict[str, Any],
    loader: DataLoader[torch.Tensor],
    mgr: stashpoint.CheckpointManager,
    t_start: float,
) -> int:
    model, optim, sched = state["model"], state["optim"], state["sched"]
    directory = Path(cfg.directory)

    every = cfg.every
    step: int = state["step"]
    calib: list[float] = []
    handle: stashpoint.SaveHandle | None = None
    staged_at = 0
    with Path(cfg.log).open("a") as log:

        def record(**rec: Any) -> None:
            log.write(json.dumps(rec) + "\n")
            log.flush()

        def report_commit() -> None:
            nonlocal handle
            if handle is None or not handle.done():
                return
            h, handle = handle, None
            err = h.exception()
            if err is not None:
                _emit("error", message=f"the save of step {staged_at} failed: {err}")
                raise SystemExit(1)
            stats = h.wait()
            record(step=staged_at, event="committed", checkpoint=ckpt_name(staged_at), persist_s=stats.persist_s)
            _emit("committed", step=staged_at, persist_s=stats.persist_s, bytes=stats.bytes_written)

        model.train()
        while True:
            for batch in loader:
                t0 = time.perf_counter()
                step += 1
                x, y = batch[:, :-1], batch[:, 1:]
                logits = model(x)
                loss = nn.functional.cross_entropy(logits.reshape(-1, p.vocab), y.reshape(-1))
                optim.zero_grad(set_to_none=True)
                loss.backward()  # type: ignore[no-untyped-call]
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optim.step()
                sched.step()
                value = float(loss.item())
                lr = optim.param_groups[0]["lr"]
                record(step=step, loss=value.hex(), lr=lr)
                step_s = time.perf_counter() - t0

                if every is None:  # time steps 3..8 (the first ones warm up), then size the interval
                    if step >= 3:
                        calib.append(step_s)
                    if len(calib) == 6:
                        startup = time.time() - cfg.launched_at - (time.perf_counter() - t_start)
                        train_s = cfg.budget_s - 2.2 * max(startup, 1.0) - (time.perf_counter() - t_start) - 3.0
                        every = _nice_interval(train_s / ((p.kill_after + 1.5) * statistics.median(calib)))
                        _emit("plan", every=every, step_s=statistics.median(calib))

                if every is not None and step % every == 0:
                    if handle is not None:  # async_save would wait for it too; report it first
                        handle.exception()
                        report_commit()
                    state["step"] = step
                    torch_s = _torch_save_fsync(state, directory / BASELINE_FILE)
                    handle = mgr.save(step, state)
                    staged_at = step
                    record(
                        step=step,
                        event="checkpoint",
                        checkpoint=ckpt_name(step),
                        blocking_ms=handle.blocking_s * 1e3,
                        staging_ms=handle.staging_s * 1e3,
                        torch_save_fsync_ms=torch_s * 1e3,
                    )
                    _emit(
                        "staged",
                        step=step,
                        blocking_ms=handle.blocking_s * 1e3,
                        staging_ms=handle.staging_s * 1e3,
                        torch_ms=torch_s * 1e3,
                    )
                report_commit()
                _emit("step", step=step, loss=value, lr=lr, step_s=step_s, inflight=handle is not None)
                if (cfg.stop_step is not None and step >= cfg.stop_step) or time.perf_counter() - t_start > cfg.max_s:
                    if handle is not None:
                        handle.wait()
                        report_commit()
                    _emit("done", step=step)
                    return 0


def _child_main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "child":
        usage = "usage: python -m stashpoint._tools.demo_train child '<json config>' (started by `stashpoint demo`)"
        print(usage, file=sys.stderr)
        return 2
    return train(ChildConfig(**json.loads(argv[1])))


# ------------------------------------------------------------------------------------------------
# the parent


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
