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
all the printing. A child is started as ``python -m stashpoint._tools.demo_train child '<json config>'``.
"""

from __future__ import annotations

import json
import math
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

from stashpoint._tools.demo_train import (
    _EVENT,
    KEEP_LAST,
    LOG_KILLED,
    LOG_RESUMED,
    PRESETS,
    STALL_S,
    ChildConfig,
    ckpt_name,
    latest_committed,
    list_checkpoints,
    prepare_dir,
    read_log,
)

__all__ = ["DemoError", "latest_committed", "list_checkpoints", "prepare_dir", "read_log", "run_demo"]


class DemoError(Exception):
    """The demo could not run to its end; the message says why."""


class _Child:
    """A training child process and the events it prints."""

    def __init__(self, cfg: ChildConfig) -> None:
        self.err: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stashpoint._tools.demo_train", "child", json.dumps(asdict(cfg))],
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
