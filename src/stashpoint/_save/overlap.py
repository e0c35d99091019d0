"""Overlap mode: copy what the optimizers update in the background, until their next step.

With ``overlap=True`` a save splits its copies into the live state's staging buffers in two:

* **eager** copies, done before the call returns: every tensor that may change before the next
  optimizer step — module buffers (BatchNorm running statistics), plain tensors, parameters that
  no optimizer of the state holds, the tensors of other stateful objects, anything whose
  provenance is unknown;
* **deferred** copies, done in the background: the parameters held by an optimizer of the state
  and that optimizer's own state tensors (moments, step counts), which only ``optimizer.step()``
  changes.

Deferred copies are made by one dedicated copy thread (not the writer thread, which runs the
collectives of distributed saves and may still be persisting the previous save): it launches the
CUDA ones on a side stream, ordered after an event recorded on the current stream at the time of
the call, then copies the CPU ones; the call itself launches none (a Python-level launch per
tensor would block for tens of microseconds each). Until the deferred copies are done, a step
pre-hook on each optimizer of the state holds its ``step()`` back: it waits for the CPU copies
and the launch, and makes the current CUDA stream wait for the GPU copies. The persist of the
save starts writing only once every copy is done.

Limits: work queued on streams other than the current one is not ordered before the copies
(join it first: ``torch.cuda.current_stream().wait_stream(s)``); a save refuses to start while
a CUDA graph is being captured; an optimizer built with ``capturable=True`` (its step may be
replayed from a graph, which runs no hook) has its tensors copied before the call returns; and a
step captured while copies are pending raises :class:`CheckpointError` instead of racing them.

Removing a hook: torch iterates an optimizer's step pre-hooks without taking a copy, so removing
one while another thread (or the hook itself) is in that loop breaks the loop. A guard is
therefore removed only where that is safe — from inside its own hook when it is the last hook,
from the thread that registered it when not inside a step, and from any thread when it is the
optimizer's only pre-hook (the usual case: it is then removed as soon as the copies are done).
A guard that cannot be removed yet does nothing any more and is removed at the next such chance.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from stashpoint import _runtime
from stashpoint._save.cudacopy import Pair, launch_cuda, mark_now, stage
from stashpoint._save.layout import Layout
from stashpoint._save.overlapsplit import Triple, hookable, optimizers_in, split
from stashpoint.errors import CheckpointError


@dataclass
class _Registry:
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards hook removal and the lists
    active: list[PendingCopies] = field(default_factory=list)  # saves whose copies are not all done
    leftover: list[_StepGuard] = field(default_factory=list)  # guards done but not removable yet


def _reg() -> _Registry:
    return _runtime.slot("save.overlap", _Registry, close=lambda _: wait_pending(), order=5, after_fork=_forked)


def _forked(reg: _Registry) -> None:
    """In a forked child (DataLoader workers): the copy thread is the parent's, so the copies it
    inherits never run there; its optimizers' hooks must not wait for them (the registry's lock
    may be held by a parent's thread: not taken)."""
    for pending in list(reg.active):
        for guard in pending._guards:
            guard.pending = None
        for event in (pending._cpu_done, pending._done):
            getattr(event, "_at_fork_reinit", lambda: None)()  # its lock may be held by a parent's thread
            event.set()


def copy_deferred(triples: Sequence[Triple]) -> None:
    """Copy CPU sources into their staging views (runs on the copy thread)."""
    for key, src, dst in triples:
        try:
            dst.copy_(src)
        except Exception as e:
            raise CheckpointError(
                f"copying tensor {key!r} into its staging buffer failed in the background: {type(e).__name__}: {e}"
            ) from e


class PendingCopies:
    """The deferred copies of one save: run on the copy thread, awaited by hooks, the persist and
    :meth:`SaveHandle.wait_staged`. Every wait returns once the copies end, whether they
    succeeded or not; only :meth:`result` raises their failure.

    The copy thread first launches the CUDA copies (``cuda``, on the side streams after the
    ``after`` events recorded at the call, gathered around ``fences``), then does the CPU
    copies, then waits for the GPU: the call itself launches none of them.
    """

    def __init__(  # noqa: PLR0917
        self,
        location: str,
        cpu: list[Triple],
        events: list[tuple[torch.device, torch.cuda.Event]],
        cuda: Sequence[Pair] = (),
        after: dict[torch.device, torch.cuda.Event] | None = None,
        fences: Sequence[int] | None = None,
    ) -> None:
        self.location = location
        self.done_at: float | None = None  # perf_counter() once every copy is done
        self.step_wait_s = 0.0  # time optimizer steps were held back (final once done)
        self._cpu = cpu
        self._events = events
        self._cuda = list(cuda)
        self._after = after or {}
        self._fences = fences
        self._cpu_done = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._waiting: list[float] = []  # start times of steps waiting for the CPU copies
        self._guards: list[_StepGuard] = []
        self._state = "made"  # then "running" (the copy thread's) or "abandoned" (the failed call's)

    def _abandon(self, error: BaseException) -> bool:
        """End these copies unrun, as the call that made them fails; False where the copy
        thread has already taken them (they then end as they run)."""
        with _reg().lock:
            if self._state == "running":
                return False
            self._state = "abandoned"
        self._error = error
        for _, event in self._events:  # the call's own copies, launched: the buffers are in use until then
            try:
                event.synchronize()
            except Exception:  # noqa: S112 - the call's error is the one to report
                continue
        self._cpu_done.set()
        self._finish()
        return True

    def run(self) -> None:
        """Launch the GPU copies, do the CPU ones, then wait for the GPU. Never raises; always
        ends the wait."""
        with _reg().lock:
            if self._state == "abandoned":
                return
            self._state = "running"
        try:
            if self._cuda:  # if this raises, no copy it launched is still running
                events = launch_cuda(self._cuda, after=self._after, fences=self._fences)
                with _reg().lock:
                    self._events += events
            if self._cpu:
                copy_deferred(self._cpu)
        except BaseException as e:
            self._error = e
        finally:
            with _reg().lock:
                now = time.perf_counter()
                self.step_wait_s += sum(now - t for t in self._waiting)
                self._waiting.clear()
                self._cpu = []
                self._cpu_done.set()
        try:
            for _, event in self._events:
                event.synchronize()
        except BaseException as e:
            self._error = self._error or e
        finally:
            self._finish()

    def _finish(self) -> None:
        reg = _reg()
        with reg.lock:
            self.done_at = time.perf_counter()
            self._events = []
            self._cuda, self._after = [], {}  # the sources may go now
            if self in reg.active:
                reg.active.remove(self)
            for guard in self._guards:
                guard.pending = None
                if not guard.try_remove():
                    reg.leftover.append(guard)
            self._guards = []
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Return once every copy has ended (not raising their failure); then remove the hooks
        this thread may remove. :class:`TimeoutError` if ``timeout`` seconds pass first."""
        if not self._done.wait(timeout):
            raise TimeoutError(
                f"the state saved to {self.location} is still being copied after {timeout} s (overlap=True)"
            )
        sweep()

    def result(self) -> None:
        """Wait for every copy; raise :class:`CheckpointError` if one failed."""
        self._done.wait()
        if self._error is not None:
            e = self._error
            if isinstance(e, CheckpointError):
                raise e
            raise CheckpointError(
                f"copying the state into staging memory failed in the background (overlap=True): "
                f"{type(e).__name__}: {e}"
            ) from e

    def hold_step(self) -> None:
        """In an optimizer's step pre-hook: wait for the CPU copies and the launch of the GPU
        ones, and order the current CUDA streams after the GPU copies (no host wait for those)."""
        if not self._done.is_set() and _capturing():
            raise CheckpointError(
                f"optimizer.step() is being captured in a CUDA graph while the save to {self.location} still "
                "copies the parameters it changes (overlap=True). Call handle.wait_staged() before capturing, "
                "build the optimizer with capturable=True (its tensors are then copied before async_save "
                "returns), or save with overlap=False."
            )
        with _reg().lock:
            waiting = not self._cpu_done.is_set()
            if waiting:
                self._waiting.append(time.perf_counter())
        if waiting:
            self._cpu_done.wait()
        with _reg().lock:  # launched by now (before the CPU copies); none left once all are done
            events = list(self._events)
        for device, event in events:
            torch.cuda.current_stream(device).wait_event(event)


class _StepGuard:
    """An optimizer step pre-hook that holds ``step()`` back until the copies are done."""

    def __init__(self, optim: torch.optim.Optimizer, pending: PendingCopies) -> None:
        self.pending: PendingCopies | None = pending
        self.thread = threading.get_ident()
        self.handle = optim.register_step_pre_hook(self)

    def __call__(self, optim: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        pending = self.pending
        if pending is not None:
            pending.hold_step()
        with _reg().lock:
            self.try_remove(in_hook=True)

    def try_remove(self, *, in_hook: bool = False) -> bool:
        """Remove the hook if that is safe here (see the module docstring); True once removed.
        The caller holds the registry's lock."""
        hooks = self.handle.hooks_dict_ref()
        if hooks is None or self.handle.id not in hooks:
            return True
        keys = list(hooks)
        if in_hook:
            safe = bool(keys[-1] == self.handle.id)
        elif threading.get_ident() == self.thread:
            safe = True
        else:
            safe = bool(keys == [self.handle.id])
        if safe:
            self.handle.remove()
            self.pending = None
        return safe


def _capturing() -> bool:
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):  # type: ignore[no-untyped-call]
        return False
    return bool(torch.cuda.is_current_stream_capturing())


def sweep() -> None:
    """Remove the guards left registered that this thread may now remove."""
    reg = _reg()
    with reg.lock:
        reg.leftover[:] = [g for g in reg.leftover if not g.try_remove()]


def wait_pending(timeout: float | None = None) -> None:
    """Wait until no save of this process is still copying from the live state."""
    reg = _reg()
    with reg.lock:
        pending = list(reg.active)
    for p in pending:
        p.wait(timeout)
    sweep()


def start(  # noqa: PLR0917
    state: Any,
    triples: Sequence[Triple],
    copier: cf.Executor,
    location: str,
    layout: Layout | None = None,
    fences: Sequence[int] | None = None,
) -> PendingCopies | None:
    """Copy what must be copied now, start the rest in the background, guard the optimizers.

    Returns the pending copies, or None when nothing is left to copy. If this raises, no copy is
    running any more and no hook is registered, so the staging buffers may be reused.
    """
    optimizers = list(dict.fromkeys(h for h in map(hookable, optimizers_in(state)) if h is not None))
    eager, deferred = split(triples, optimizers, layout)
    if fences is None:
        fences = sorted(d.data_ptr() for _, _, d in triples if d.numel())
    events: list[tuple[torch.device, torch.cuda.Event]] = []
    after: dict[torch.device, torch.cuda.Event] = {}
    cuda_late = [(s, d) for _, s, d in deferred if s.is_cuda]
    try:
        stage([(s, d) for _, s, d in eager if not s.is_cuda])
        cuda_eager = [(s, d) for _, s, d in eager if s.is_cuda]
        if cuda_eager:
            events = launch_cuda(cuda_eager, fences=fences)
            for device, event in events:  # training's next kernels run after these copies
                torch.cuda.current_stream(device).wait_event(event)
        if cuda_late:  # launched by the copy thread, after what is queued now
            after = mark_now(s.device for s, _ in cuda_late)
    except BaseException:
        for _, event in events:
            try:
                event.synchronize()
            except Exception:  # noqa: S112 - the first error is the one to report
                continue
        raise
    cpu_late = [t for t in deferred if not t[1].is_cuda]
    if not cpu_late and not events and not cuda_late:
        return None
    pending = PendingCopies(location, cpu_late, events, cuda_late, after, fences)
    reg = _reg()
    try:
        with reg.lock:
            reg.active.append(pending)
            if deferred:
                for optim in optimizers:
                    pending._guards.append(_StepGuard(optim, pending))
        try:
            copier.submit(pending.run)
        except RuntimeError:  # the copy thread is gone (interpreter shutdown): copy here
            pending.run()
    except BaseException as e:  # a hook refused, a Ctrl-C: no copy left to wait for, no hook holding a step
        if not pending._abandon(e):
            pending._done.wait()  # the copy thread took it: its buffers are in use until it ends
        raise
    return pending
