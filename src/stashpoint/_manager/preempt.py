"""Preemption: a signal (SIGTERM) asks the job to stop; the manager saves and exits at a safe point.

A signal handler only notes the signal: a collective save cannot start inside it (the training
thread may be inside its own all-reduce). The next ``maybe_save`` of every rank is the safe
point. The ranks agree there whether any of them was signalled (a launcher may signal one node
only), over a gloo group of stashpoint's own, never the training's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from types import FrameType
from typing import Any, NoReturn

from stashpoint._core.policy import seconds_or_none
from stashpoint._dist import group as _dist
from stashpoint._dist.gloo import tree_max
from stashpoint._manager.preemptgroup import signal_context
from stashpoint.errors import CheckpointError

log = logging.getLogger("stashpoint")

_GRACE_S = 1.0  # past the deadline, for stop() to report before the watchdog ends the process


class Preemption:
    """Handlers for ``signals`` (main thread only, from :meth:`install`); :meth:`agreed` says
    whether any rank got one. ``close`` puts the previous handlers back.

    A watchdog thread enforces the deadline where the safe point never comes: the training
    thread stuck in a collective or a long evaluation (a Python handler runs only once the
    main thread is back in Python; the signal's byte reaches the watchdog at once through
    ``signal.set_wakeup_fd``). Once the deadline has passed it ends the process as the signal
    would have (exit status 128 + signal). A child forked meanwhile gets the signals' previous
    handlers back and no wakeup pipe: its signals are its own, never the parent's."""

    def __init__(self, deadline_s: float, signals: Sequence[int], world: int, owner: str = "") -> None:
        if deadline_s is None:
            raise ValueError("preemption_deadline must be a finite number of seconds above 0, got None")
        seconds_or_none("preemption_deadline", deadline_s)
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "preemption handling installs signal handlers, which Python allows only in the main thread: "
                "create this CheckpointManager there"
            )
        open_ = _handling()
        if open_ is not None:
            # each would save its own step at its own maybe_save and exit: the second never saves
            # the step the first stopped at, and the two resume at different steps
            raise ValueError(
                f"another CheckpointManager of this process ({open_.owner}) handles preemption already: one manager "
                "per process may take preemption_deadline. Keep the models of one job in one manager's state "
                "({'gen': G, 'disc': D, ...}), or give preemption_deadline to one manager and check its "
                "`preempted` to save the other"
            )
        if isinstance(signals, (int, str)) or not isinstance(signals, Iterable):
            raise TypeError(
                f"preemption_signals must be a sequence of signals, e.g. (signal.SIGTERM,); got {signals!r}"
            )
        signals = tuple(signals)  # once: an iterator would be used up by the check
        for sig in signals:  # before anything is taken over: a handler refused half-way left SIGTERM ignored
            if sig not in signal.valid_signals() or sig in (signal.SIGKILL, signal.SIGSTOP):
                raise ValueError(
                    f"preemption_signals holds {signal_name(sig)}, "
                    "which a program cannot catch; give signals such as SIGTERM, SIGINT or SIGUSR1"
                )
        self.owner: str = owner  # what a second manager's refusal names
        self.deadline_s = float(deadline_s)
        self.signum: int | None = None
        self.since: float | None = None
        self.mine = False  # this rank got the signal (not only learnt of another's)
        self.handled = False  # stop() ran: the signal was answered at a safe point
        self.stopping = False  # stop() is saving at the safe point: it reports its own outcome
        self._ctx: _dist.DistContext | None = None
        if world > 1:  # every rank creates its manager at the same point, so every rank asks for this group
            self._ctx = signal_context()
        self._signals = tuple(signals)
        self._previous: dict[int, Any] = {}
        self._wakeup: tuple[int, int] | None = None  # the pipe the signals' bytes come through
        # its ends still open, each closed by whoever takes it out (one dict.pop: a signal's
        # handler running in between never closes an end twice, nor a number reused since)
        self._ends: dict[str, int] = {}
        self._giving = False  # in _give_back: a signal meanwhile is handed on at its end
        self._forward: list[int] = []
        self._given: dict[int, Any] = {}
        self._closed = threading.Event()
        self._abandoned = False  # closed from another thread: handlers and pipe left to _give_back
        self._watchdog: threading.Thread | None = None
        self._orphan: weakref.finalize[Any, Any] | None = None
        self._pid = os.getpid()

    def install(self, owner: object = None) -> None:
        """Take over the signals (last, once the manager is set up: a manager that failed to open
        must leave SIGTERM's default action alone), and start the watchdog. An ``owner``
        collected without closing this (a notebook's manager left open, its cell run again)
        closes it then: its handler and watchdog must not outlive it, nor refuse the next one."""
        for left in list(_left):  # managers closed from other threads: given back here first
            left._give_back()
        try:
            for sig in self._signals:
                self._previous[sig] = signal.signal(sig, self._note)
        except BaseException:  # each taken so far is given back: the program's signals stay its own
            for sig, previous in self._previous.items():
                signal.signal(sig, _settable(previous))
            self._previous.clear()
            raise
        r, w = os.pipe()
        os.set_blocking(w, False)
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        if old != -1:  # the program's own (asyncio's): left to it; the watchdog polls instead
            signal.set_wakeup_fd(old)
            os.close(r)
            os.close(w)
        else:
            self._wakeup, self._ends = (r, w), {"r": r, "w": w}
        _live.add(self)
        if owner is not None:
            self._orphan = weakref.finalize(owner, self._orphaned)
        self._watchdog = threading.Thread(target=self._watch, name="stashpoint-preemption", daemon=True)
        self._watchdog.start()

    def _orphaned(self) -> None:
        pending = self.close()
        if pending is not None:  # noted and never answered: it takes its course now
            signal.raise_signal(pending)

    def _forked(self) -> None:
        """In a child forked from this process (multiprocessing): the signals are the child's own
        again, as before the manager took them over; the parent's pipe is not the child's."""
        self._closed.set()
        self._abandoned = True
        if threading.current_thread() is threading.main_thread():
            for sig, previous in list(self._previous.items()):
                signal.signal(sig, _settable(previous))
            if self._wakeup is not None:
                signal.set_wakeup_fd(-1)
        self._close_end("r")
        self._close_end("w")
        self._wakeup = None

    def _close_end(self, end: str) -> None:
        fd = self._ends.pop(end, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self._closed.is_set():  # closed (from another thread, or chained to): the signal is the program's again
            if signal.getsignal(signum) != self._note:  # called by a handler chaining to ours
                target = self._given.get(signum, self._previous.get(signum, signal.SIG_DFL))
                target = _settable(_past_closed(signum, target))
                if callable(target):
                    target(signum, frame)
                elif target == signal.SIG_DFL:
                    signal.signal(signum, signal.SIG_DFL)
                    signal.raise_signal(signum)
                return
            self._forward.append(signum)  # raised again once the program's handler is back
            if not self._giving:
                self._give_back()
            return
        if self.signum is None:
            self.signum, self.since, self.mine = signum, time.monotonic(), True
            # logging from a handler may deadlock on the logging lock: say it at the safe point

    def _watch(self) -> None:
        """End the process once the deadline has passed since the first signal, unless a safe
        point answered it first."""
        first: tuple[int, float] | None = None
        # until closed, and with a wakeup pipe until its end is seen (its read end closed here)
        while not (self._closed.is_set() and (self._wakeup is None or self._abandoned)):
            wait = 0.5 if first is None else max(0.01, min(0.5, first[1] + self.deadline_s - time.monotonic()))
            got = self._signals_within(wait)
            if self._closed.is_set():
                continue  # the manager is closed: the signals are the program's again
            for signum in got:
                # a byte for a signal whose handler is not this manager's now (another manager's)
                # is not ours to count; a second one (a launcher passing on what the scheduler
                # sent every process) changes nothing: the deadline runs from the first
                if first is None and signal.getsignal(signum) == self._note:
                    first = (signum, time.monotonic())
            if first is None and self.signum is not None and self.since is not None:
                first = (self.signum, self.since)  # noted by the handler (no wakeup pipe)
            # at the safe point, stop() gives up at the deadline and says what a restart loads: a
            # moment's grace for that before the watchdog ends the process itself
            grace = _GRACE_S if self.stopping else 0.0
            if first is not None and not self.handled and time.monotonic() >= first[1] + self.deadline_s + grace:
                where = "the save at the safe point ended" if self.stopping else "training reached a safe point"
                exit_now(first[0], f"the {self.deadline_s:g} s deadline passed before {where} (maybe_save)")

    def _signals_within(self, timeout: float) -> list[int]:
        if self._wakeup is None:
            self._closed.wait(timeout)
            return []
        # the read end is this thread's alone (closed here, never by close(): a number reused
        # by another file meanwhile must never be read from); close() closes the write end
        ready, _, _ = select.select([self._wakeup[0]], [], [], timeout)
        if not ready:
            return []
        got = os.read(self._wakeup[0], 64)
        if not got:  # the write end closed: the manager is closing
            self._close_end("r")
            self._wakeup = None
            return []
        return [b for b in got if b in self._signals]  # the pipe carries every handled signal (SIGINT too)

    def agreed(self, step: int) -> int | None:
        """The signal any rank got (this rank's, or SIGTERM for another's), or None: a collective
        over every rank of the manager when there are several. Ranks at different steps (some
        skipped a maybe_save) are refused on every rank, rather than paired up."""
        if self._ctx is None:
            return self.signum
        import torch

        if self._ctx.closed:  # shutdown() destroyed it meanwhile: every rank makes a fresh one here
            self._ctx = signal_context()
        flag = torch.tensor([self.signum or 0, step, -step], dtype=torch.int64)
        try:
            tree_max(flag, self._ctx.group)
        except Exception as e:  # gloo's own error says only that a connection closed
            _dist.forget(self._ctx)  # the next manager's makes a fresh one
            raise CheckpointError(
                f"the ranks' check for a preemption signal at step {step} failed: another rank left the job (it "
                "crashed, or was preempted and ended at its deadline before reaching this step) "
                f"({type(e).__name__}: {str(e)[:300]})"
            ) from e
        got, hi, lo = int(flag[0]), int(flag[1]), -int(flag[2])
        if hi != lo:
            raise CheckpointError(
                f"the ranks called maybe_save at different steps ({lo} to {hi}): with preemption_deadline every "
                "maybe_save is collective, so every rank must call it at every step, with the same step number"
            )
        if got and self.signum is None:
            self.signum, self.since = got, time.monotonic()
        return got or None

    def left(self) -> float:
        """Seconds left of the deadline, counted from when this rank learnt of the signal."""
        since = self.since if self.since is not None else time.monotonic()
        return self.deadline_s - (time.monotonic() - since)

    def close(self) -> int | None:
        """Put the previous handlers back; the signal noted and never answered at a safe point
        (it came after the last maybe_save), for the manager to raise again once it is closed,
        so that the process ends as the signal asked."""
        answered = self.handled
        if self._orphan is not None:
            self._orphan.detach()
        _live.discard(self)
        if threading.current_thread() is not threading.main_thread():
            # handlers and the wakeup fd can change only there: at this manager's next signal
            # (its handler runs there) or when another manager is opened there
            self._abandoned = True
            _left.add(self)
        # a signal before this is noted and pending below; one after it goes to the program's
        # handler: none falls between the two
        self._closed.set()
        pending = self.signum if self.mine and not answered else None
        self.handled = True
        if not self._abandoned:
            self._give_back()
        return pending

    def _give_back(self) -> None:
        """(In the main thread.) The previous handlers back where this manager's still are, the
        wakeup fd given up where it is still this pipe's, and the pipe closed: its write end
        here, its read end by the watchdog, or here once a watchdog that left it has ended.
        Safe to run again, and from this manager's handler while it runs: each handler is
        taken out of ``_previous`` once it is back (and kept in ``_given``, for a handler of the
        program's that calls this one's), each pipe end taken out before it is closed, and a
        signal that comes meanwhile is raised again at the end, for the handler given back."""
        self._giving = True
        try:
            _left.discard(self)
            for sig in list(self._previous):
                previous = self._previous.get(sig, _GONE)
                if previous is _GONE:
                    continue
                if signal.getsignal(sig) == self._note:
                    given = _settable(_past_closed(sig, previous))
                    signal.signal(sig, given)
                    self._given[sig] = given
                    self._previous.pop(sig, None)
            w = self._ends.get("w")
            if w is not None:
                current = signal.set_wakeup_fd(-1)
                if current != w:  # another owner took it since (asyncio): theirs stays
                    signal.set_wakeup_fd(current)
                self._close_end("w")
            if self._abandoned and self._watchdog is not None and "r" in self._ends:
                # an abandoned watchdog ends within 0.5 s without reading on (a second, at most,
                # in a signal's handler or a manager's opening)
                self._watchdog.join(1.0)
                if not self._watchdog.is_alive():
                    self._close_end("r")
        finally:
            self._giving = False
        while self._forward:
            sig = self._forward.pop(0)
            if signal.getsignal(sig) == self._note:  # nothing to give it back to (lost): the default
                signal.signal(sig, signal.SIG_DFL)
            signal.raise_signal(sig)


_GONE = object()


def _settable(handler: Any) -> Any:
    """A handler ``signal.signal`` takes: one installed from C code (``getsignal`` gave None)
    cannot be put back from Python; the default action stands in for it."""
    return signal.SIG_DFL if handler is None else handler


def _past_closed(sig: int, handler: Any) -> Any:
    """``handler``, or where it is the handler of a manager closed since (managers closed out
    of order), the handler that one took over, and so on."""
    owner = getattr(handler, "__self__", None)
    while isinstance(owner, Preemption) and owner._closed.is_set() and handler == owner._note:
        handler = owner._previous.pop(sig, signal.SIG_DFL)
        owner = getattr(handler, "__self__", None)
    return handler


_live: weakref.WeakSet[Preemption] = weakref.WeakSet()
_left: set[Preemption] = set()  # closed from other threads, not yet given back (held: their fds are open)


def _handling() -> Preemption | None:
    """The manager's preemption handling open in this process, if any."""
    return next((p for p in _live if p._pid == os.getpid() and not p._closed.is_set()), None)


_unhooked: list[int] = []  # the wakeup fd taken away for a fork of the main thread


def _before_fork() -> None:
    """No wakeup fd across a fork: a signal the child gets before its own hook has run would
    otherwise write to the parent's pipe and start the parent's deadline."""
    if threading.current_thread() is threading.main_thread():
        for p in _live:
            if p._wakeup is not None and not p._closed.is_set():
                current = signal.set_wakeup_fd(-1)
                if current == p._wakeup[1]:
                    _unhooked.append(current)
                else:  # another owner's (asyncio's): left where it was
                    signal.set_wakeup_fd(current)
                break


def _after_fork_in_parent() -> None:
    while _unhooked:
        signal.set_wakeup_fd(_unhooked.pop(), warn_on_full_buffer=False)


def _after_fork_in_child() -> None:
    _unhooked.clear()
    for p in list(_live) + list(_left):  # managers closed from other threads too: the child's copies
        if p._pid != os.getpid():
            p._forked()
    _live.clear()
    _left.clear()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_now(signum: int, why: str) -> NoReturn:
    """End the process at once, as the signal's default action would (no cleanup runs: the
    newest committed step is whole, and a save cut short is cleaned up at the next start)."""
    log.warning("stashpoint: %s: %s; exiting now, without a new checkpoint", signal_name(signum), why)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(128 + signum)
