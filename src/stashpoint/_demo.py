"""``stashpoint demo``: train a small transformer, checkpoint it asynchronously, kill it, resume it.

The demo runs in two processes that train the same model the same way:

1. a training child saves through a :class:`stashpoint.CheckpointManager` (asynchronous saves)
   every K steps (and, for comparison, times a plain ``torch.save`` + fsync of the same state)
   until the parent kills it with SIGKILL, preferably while a save is still being written;
2. a second child opens a manager on the same directory (which removes what an interrupted save
   left), restores the latest *committed* checkpoint and trains on.

Each child writes one JSON line per step to a log in the demo directory; the parent then checks
that the resumed run's losses equal the killed run's, bit for bit, for the steps both ran.

The children talk to the parent through JSON events on stdout (one per line); the parent does
all the printing. A child is started as ``python -m stashpoint._demo child '<json config>'``.
"""

from __future__ import annotations

import json
import math
import os
import queue
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import stashpoint
from stashpoint._manager import LOCK_NAME

MANIFEST = "manifest.json"
KEEP_LAST = 3
CKPT_RE = re.compile(r"^step-(\d{8})$")
LOG_KILLED = "phase1-killed.jsonl"
LOG_RESUMED = "phase2-resumed.jsonl"
BASELINE_FILE = ".torch-save-baseline.pt"
_DEMO_FILES = {LOG_KILLED, LOG_RESUMED, BASELINE_FILE, LOCK_NAME}
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
    return f"step-{step:08d}"


def list_checkpoints(directory: Path) -> list[tuple[int, Path, bool]]:
    """``(step, path, committed)`` for every ``step-*`` directory, oldest first."""
    found = []
    if directory.is_dir():
        for p in directory.iterdir():
            m = CKPT_RE.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p, (p / MANIFEST).is_file()))
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
        foreign = [e.name for e in entries if not (e.name in _DEMO_FILES or (CKPT_RE.match(e.name) and e.is_dir()))]
        if foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise ValueError(
                f"{directory} is not empty and does not look like a stashpoint demo directory (it holds "
                f"{shown}); the demo clears its directory first, so pass a new or empty one with --dir"
            )
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
        print("usage: python -m stashpoint._demo child '<json config>' (started by `stashpoint demo`)", file=sys.stderr)
        return 2
    return train(ChildConfig(**json.loads(argv[1])))


# ------------------------------------------------------------------------------------------------
# the parent


class DemoError(Exception):
    """The demo could not run to its end; the message says why."""


class _Child:
    """A training child process and the events it prints."""

    def __init__(self, cfg: ChildConfig) -> None:
        self.err: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stashpoint._demo", "child", json.dumps(asdict(cfg))],
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.other: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(_EVENT):
                self.events.put(json.loads(line[len(_EVENT) :]))
            else:
                self.other.append(line.rstrip("\n"))
        self.events.put(None)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            try:
                ev = self.events.get(timeout=STALL_S)
            except queue.Empty:
                self.kill()
                raise DemoError(f"the training process reported nothing for {STALL_S:.0f} s; stopped it") from None
            if ev is None:
                return
            if ev["event"] == "error":
                raise self.failed(f"the training process failed: {ev['message']}")
            yield ev

    def kill(self) -> None:
        """SIGKILL (on POSIX; TerminateProcess on Windows): no handler runs, nothing is flushed."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def failed(self, what: str) -> DemoError:
        self.kill()
        self.err.seek(0)
        err = self.err.read().decode(errors="replace").splitlines()
        detail = "\n".join(self.other[-10:] + err[-30:])
        return DemoError(f"{what} (exit code {self.proc.returncode})" + (f":\n{detail}" if detail else ""))

    def close(self) -> None:
        self.kill()
        self.err.close()


def _mb(n: float) -> str:
    return f"{n / 1e6:.0f} MB" if n >= 10e6 else f"{n / 1e6:.1f} MB"


def _ms(x: float) -> str:
    return f"{x:.0f} ms" if x >= 100 else f"{x:.1f} ms"


def _loss_cell(hexval: str) -> str:
    return f"{float.fromhex(hexval):.6f} {hexval}"


class _Demo:
    def __init__(self, directory: Path, seconds: float, every: int | None, quick: bool, echo: Callable[[str], None]):
        self.dir = directory
        self.where = str(directory)
        self.seconds = seconds
        self.preset_name = "quick" if quick else "full"
        self.p = PRESETS[self.preset_name]
        self.every = every if every is not None else self.p.every
        self.echo = echo
        self.launched_at = time.time()
        self.t0 = time.perf_counter()
        self.staged: dict[int, dict[str, Any]] = {}  # step -> the "staged" event, plus its loss
        self.saves: list[tuple[float, float, bool]] = []  # (stashpoint ms, torch.save+fsync ms, first in process)
        self.ckpt_bytes = 0
        self.fresh_process = True

    def _config(self, log: str, *, resume: bool, stop_step: int | None) -> ChildConfig:
        return ChildConfig(
            directory=self.where,
            log=str(self.dir / log),
            preset=self.preset_name,
            every=self.every,
            resume=resume,
            stop_step=stop_step,
            budget_s=self.seconds,
            launched_at=self.launched_at,
            max_s=10 * self.seconds + 120,
        )

    # -- printing ------------------------------------------------------------------------------

    def _stride(self) -> int:
        return max(1, self.every // 4) if self.every else 10

    def _show_step(self, ev: dict[str, Any], suffix: str = "", force: bool = False) -> None:
        step = ev["step"]
        if step in self.staged:
            self.staged[step].update(loss=ev["loss"], mark=suffix)  # printed with the checkpoint line
        elif force or step % self._stride() == 0:
            timing = f"({ev['step_s']:.2f} s/step)"
            self.echo(f"  step {step:5d}  loss {ev['loss']:.4f}  lr {ev['lr']:.2e}  {timing}{suffix}")

    def _checkpoint_line(self, step: int, persist: str) -> None:
        s = self.staged[step]
        ratio = s["torch_ms"] / s["blocking_ms"] if s["blocking_ms"] > 0 else math.inf
        note = "  [first save of this process: allocates the staging buffers]" if self.fresh_process else ""
        self.saves.append((s["blocking_ms"], s["torch_ms"], self.fresh_process))
        self.fresh_process = False
        self.echo(
            f"  step {step:5d}  loss {s['loss']:.4f}  checkpoint {ckpt_name(step)}: stashpoint blocked "
            f"{_ms(s['blocking_ms'])} ({persist}) | torch.save+fsync {_ms(s['torch_ms'])} ({ratio:.1f}x)"
            f"{s.get('mark', '')}{note}"
        )

    def _committed(self, ev: dict[str, Any]) -> None:
        self.ckpt_bytes = ev["bytes"]
        persist = f"persisted {_mb(ev['bytes'])} in {ev['persist_s']:.2f} s in background"
        self._checkpoint_line(ev["step"], persist)

    # -- the phases ----------------------------------------------------------------------------

    def run(self) -> int:
        prepare_dir(self.dir)
        self.echo("stashpoint demo: asynchronous checkpoints of a small transformer, a SIGKILL, and an exact resume")
        self.echo("")
        killed_at, inflight = self.train_and_kill()
        resumed_from = self.resume(killed_at, inflight)
        return self.compare(resumed_from)

    def _saving_line(self) -> str:
        return (
            f"CheckpointManager.save (asynchronous) every {self.every} steps into {self.where}/step-<step>, "
            f"keeping the newest {KEEP_LAST}"
        )

    def train_and_kill(self) -> tuple[int, int | None]:
        """Phase 1: train until a few checkpoints exist, then SIGKILL the trainer.

        The kill comes at the first step after a save started whose background write is still
        running (a save in flight), or else half an interval after the last save committed.
        Either way the killed run has logged steps past the checkpoint the resume will use.
        """
        p, echo = self.p, self.echo
        child = _Child(self._config(LOG_KILLED, resume=False, stop_step=None))
        committed = 0
        inflight: int | None = None
        try:
            for ev in child:
                kind = ev["event"]
                if kind == "ready":
                    echo(
                        f"model    transformer LM, {ev['params'] / 1e6:.2f}M parameters ({p.layers} layers, d_model "
                        f"{p.d_model}, vocab {p.vocab}, dropout 0.1), AdamW + warmup/cosine LR"
                    )
                    echo(
                        f"data     {p.samples} synthetic sequences of {p.seq_len} tokens, batch {p.batch}, shuffled by "
                        f"stashpoint.StatefulSampler; CPU, {ev['threads']} torch thread(s)"
                    )
                    if self.every is not None:
                        echo(f"saving   {self._saving_line()}")
                    echo("")
                    echo(f"[1/3] training; the parent kills this process with SIGKILL after {p.kill_after} checkpoints")
                elif kind == "plan":
                    self.every = int(ev["every"])
                    echo(f"  ({ev['step_s']:.2f} s/step, so: {self._saving_line()})")
                elif kind == "staged":
                    self.staged[ev["step"]] = {**ev, "loss": math.nan}
                    inflight = ev["step"]
                elif kind == "committed":
                    committed += 1
                    inflight = None
                    self._committed(ev)
                elif kind == "step":
                    self._show_step(ev)
                    step, last = ev["step"], max(self.staged, default=0)
                    mid_save = ev["inflight"] and len(self.staged) >= p.kill_after and step > last
                    between = committed >= p.kill_after and step >= last + max(1, (self.every or 2) // 2)
                    if mid_save or between:
                        child.kill()
                        break
            else:
                raise child.failed("the training process ended before the parent could kill it")
        finally:
            child.close()
        if inflight is not None:
            echo(f"  SIGKILL at step {step}: killed the training process while {ckpt_name(inflight)} was being written")
            self._checkpoint_line(inflight, "still persisting in background when killed")
        else:
            n = step - last
            echo(
                f"  SIGKILL at step {step}: killed the training process {n} step{'s' * (n != 1)} after "
                f"{ckpt_name(last)} (no save was in flight: each one committed within a training step)"
            )
        return step, inflight

    def resume(self, killed_at: int, inflight: int | None) -> tuple[int, str]:
        """Phase 2: a new process loads the newest committed checkpoint and trains on."""
        echo = self.echo
        echo("")
        echo(f"[2/3] after the crash, {self.where} holds:")
        for _, path, ok in list_checkpoints(self.dir):
            what = "committed (has manifest.json)"
            if not ok:
                what = "INCOMPLETE: no manifest.json (its save was cut short); ignored"
            echo(f"  {path.name}  {what}")
        latest = latest_committed(self.dir)
        if latest is None:
            raise DemoError(f"no committed checkpoint in {self.where} after the kill")
        assert self.every is not None
        stop = max(read_log(self.dir / LOG_KILLED), default=killed_at) + max(2, self.every // 2)
        echo(
            f"  a new process opens a CheckpointManager on it (which removes incomplete saves), restores "
            f"{latest[1].name}, the newest committed step, and trains through step {stop}"
        )
        self.fresh_process = True
        child = _Child(self._config(LOG_RESUMED, resume=True, stop_step=stop))
        killed = read_log(self.dir / LOG_KILLED)
        done = False
        try:
            for ev in child:
                kind = ev["event"]
                if kind == "resumed":
                    echo(
                        f"  loaded {ev['path']} in {ev['load_ms']:.0f} ms, checksums verified: model, AdamW, LR "
                        f"scheduler, RNG states and data position (step {ev['step']})"
                    )
                elif kind == "staged":
                    self.staged[ev["step"]] = {**ev, "loss": math.nan}
                elif kind == "committed":
                    self._committed(ev)
                elif kind == "step":
                    before = killed.get(ev["step"])
                    same = ""
                    if before is not None:
                        same = "  = killed run" if float(ev["loss"]).hex() == before else "  != killed run"
                    self._show_step(ev, same, force=ev["step"] == latest[0] + 1)
                elif kind == "done":
                    done = True
            child.proc.wait()
            if not done or child.proc.returncode != 0:
                raise child.failed("the resumed training process did not finish")
        finally:
            child.close()
        return latest[0], latest[1].name

    def compare(self, resumed_from: tuple[int, str]) -> int:
        """Phase 3: the losses both runs computed for the same steps, bit for bit."""
        echo = self.echo
        killed = read_log(self.dir / LOG_KILLED)
        resumed = read_log(self.dir / LOG_RESUMED)
        overlap = sorted(set(killed) & set(resumed))
        echo("")
        if not overlap:
            echo("[3/3] no step was run by both (the kill came right after a checkpoint committed); run the demo again")
            return 1
        echo(
            f"[3/3] losses of the steps both ran ({overlap[0]}..{overlap[-1]}): the killed run vs the run resumed from "
            f"{resumed_from[1]}"
        )
        differ = [s for s in overlap if killed[s] != resumed[s]]
        rows = overlap
        if len(overlap) > 10:  # ten, evenly spread, with the first and the last
            rows = sorted({overlap[round(i * (len(overlap) - 1) / 9)] for i in range(10)})
        echo(f"  {'step':>5}  {'killed run':<31}  {'resumed run':<31}  same bits")
        for s in rows:
            mark = "NO" if s in differ else "yes"
            echo(f"  {s:5d}  {_loss_cell(killed[s]):<31}  {_loss_cell(resumed[s]):<31}  {mark}")
        if len(rows) < len(overlap):
            echo(f"  ({len(rows)} of {len(overlap)} steps shown)")
        echo("")
        if self.saves:
            echo(f"checkpoints  {len(self.saves)} saves of {_mb(self.ckpt_bytes)}; training was blocked per save:")
            later = [x for x in self.saves if not x[2]] or self.saves
            blocked = statistics.median(b for b, _, _ in later)
            plain = statistics.median(t for _, t, _ in later)
            first = [b for b, _, f in self.saves if f]
            echo(
                f"               stashpoint (async)    median {_ms(blocked):>8}"
                + (f"  (the first save of each process: {', '.join(_ms(b) for b in first)})" if first else "")
            )
            echo(f"               torch.save + fsync     median {_ms(plain):>8}  ({plain / blocked:.1f}x longer)")
        echo(f"files        {self.where} (logs: {LOG_KILLED}, {LOG_RESUMED})")
        echo(f"time         {time.perf_counter() - self.t0:.0f} s")
        if not differ:
            echo(f"bitwise identical: yes ({len(overlap)} of {len(overlap)} overlapping steps)")
            return 0
        echo(f"bitwise identical: NO ({len(differ)} of {len(overlap)} steps differ, the first is step {differ[0]})")
        return 1


def run_demo(
    directory: Path,
    *,
    seconds: float = 60.0,
    every: int | None = None,
    quick: bool = False,
    echo: Callable[[str], None] = print,
) -> int:
    """Run the whole demo; return 0 if the resumed losses are bitwise identical to the killed run's, else 1.

    Raises :class:`DemoError` if a training process fails, ``ValueError`` if ``directory`` is unusable.
    """
    return _Demo(directory.expanduser(), seconds, every, quick, echo).run()


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
