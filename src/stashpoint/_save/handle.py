"""SaveStats and SaveHandle: what a save reports, and the handle of a save in flight."""

from __future__ import annotations

import concurrent.futures as cf
import os
from dataclasses import dataclass
from typing import Protocol

from stashpoint._core.policy import seconds_or_none
from stashpoint.errors import CheckpointError


class _Copies(Protocol):
    """The background copies of an ``overlap=True`` save (``_overlap.PendingCopies``)."""

    def wait(self, timeout: float | None = None) -> None: ...

    def done(self) -> bool: ...


@dataclass(frozen=True)
class SaveStats:
    """Figures of one save. Times are in seconds.

    ``bytes_written``, ``num_tensors`` and ``num_files`` describe the whole checkpoint (all ranks
    of a distributed save); ``rank_bytes_written`` is this rank's share. The times are this
    rank's:

    - ``blocking_s``: the call (``async_save``, ``save``'s staging part): the training stall;
    - ``staging_s``: the copies made inside the call (all of them unless ``overlap=True``);
    - ``staged_s``: from the start of the call until every tensor had been copied out of the
      live state (with ``overlap=True`` the background copies end after the call returns);
    - ``step_wait_s``: with ``overlap=True``, how long optimizer steps were held back waiting
      for the background copies (the rest of the stall the save caused);
    - ``persist_s``: the background part (waiting for the copies, writing, fsync, commit);
    - ``total_s``: from the start of the call until the checkpoint was committed.

    ``writer`` says where this rank's shard files were written: ``"thread"`` (the writer thread)
    or ``"process"`` (the writer process). ``staged_bytes`` is what this rank copied out of the
    live state: every tensor it holds, except in a distributed save of a structure saved before,
    where each rank copies only what it writes (a replicated tensor is copied by one rank).
    ``staging_pinned`` is None when the state holds no CUDA tensor; else whether the staging
    memory was page-locked (False: CUDA refused to pin it, a warning said why, and the copies
    from the GPU were synchronous; each later save tries again).
    """

    path: str
    bytes_written: int
    num_tensors: int
    num_files: int
    blocking_s: float
    staging_s: float
    persist_s: float
    total_s: float
    step: int | None = None
    skipped: bool = False
    rank_bytes_written: int = 0
    staged_s: float = 0.0
    step_wait_s: float = 0.0
    writer: str = "thread"
    staged_bytes: int = 0
    staging_pinned: bool | None = None

    @property
    def throughput_gbps(self) -> float:
        """Persist throughput in GB/s (10^9 bytes per second)."""
        return self.bytes_written / self.persist_s / 1e9 if self.persist_s > 0 else float("inf")

    def __str__(self) -> str:
        if self.skipped:
            return f"save of step {self.step} to {self.path} skipped: the previous save was still persisting"
        overlap = ""
        if self.staged_s > self.blocking_s:
            overlap = f", all copied after {self.staged_s * 1e3:.1f} ms, steps held {self.step_wait_s * 1e3:.1f} ms"
        return (
            f"{self.bytes_written / 1e9:.3f} GB to {self.path}: blocked {self.blocking_s * 1e3:.1f} ms "
            f"(staging {self.staging_s * 1e3:.1f} ms{overlap}), persisted in {self.persist_s:.2f} s "
            f"({self.throughput_gbps:.2f} GB/s)"
        )


class SaveHandle:
    """A save in progress. The state was staged when this handle was returned — except, with
    ``overlap=True``, the tensors the optimizers' next ``step()`` will update (see
    :meth:`wait_staged`)."""

    def __init__(
        self,
        path: str,
        future: cf.Future[SaveStats],
        blocking_s: float,
        staging_s: float,
        step: int | None = None,
        *,
        copies: _Copies | None = None,
    ) -> None:
        self.path = path
        self.step = step
        self._future = future
        self._copies = copies
        self.blocking_s = blocking_s
        self.staging_s = staging_s
        self._reported = False  # the failure reached the caller through wait() or exception()
        self._pid = os.getpid()

    def _check_process(self) -> None:
        """A process forked while the save ran has none of the threads that end it: waiting
        there would never return."""
        if os.getpid() != self._pid and not self._future.done():
            raise CheckpointError(
                f"the save to {self.path} runs in process {self._pid}, which this process was forked from: it "
                "cannot be waited for here (it goes on there)"
            )

    def wait(self, timeout: float | None = None) -> SaveStats:
        """Block until the checkpoint is committed and durable; return its figures.

        Raises :class:`CheckpointError` (with the path and the cause) if the background write
        (or, with ``overlap=True``, a background copy) failed, and :class:`TimeoutError` if
        ``timeout`` seconds pass first.
        """
        seconds_or_none("timeout", timeout, zero=True)
        self._check_process()
        try:
            return self._future.result(timeout)
        except cf.TimeoutError:
            raise TimeoutError(f"the save to {self.path} is still running after {timeout:.3g} s") from None
        except BaseException as e:
            self._reported = self._reported or (self._future.done() and self._future.exception() is e)
            raise
        finally:
            if self._copies is not None and self._future.done():
                self._copies.wait()  # already done: removes what step hooks are left, from this thread

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until every tensor of this save has been copied out of the live state.

        Only an ``overlap=True`` save copies after the call returns; for any other save this
        returns at once. Once it returns, the state may be changed in any way without affecting
        this checkpoint: call it before changing, outside an optimizer's ``step()``, a tensor that
        an optimizer of the state holds (its parameters and their optimizer state) — an EMA or
        weight update under ``torch.no_grad()``, ``load_state_dict``, ``stashpoint.load``.

        A failed copy is not raised here (the save fails, and :meth:`wait` raises it).
        :class:`TimeoutError` if ``timeout`` seconds pass first.
        """
        if self._copies is not None:
            self._check_process()
            self._copies.wait(timeout)

    def staged(self) -> bool:
        """True once every tensor of this save has been copied out of the live state."""
        return self._copies is None or self._copies.done()

    def done(self) -> bool:
        """True once the save has committed or failed."""
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The background failure, or None if the save succeeded (waits like :meth:`wait`)."""
        self._check_process()
        try:
            exc = self._future.exception(timeout)
        except cf.TimeoutError:
            raise TimeoutError(f"the save to {self.path} is still running after {timeout:.3g} s") from None
        self._reported = self._reported or exc is not None
        return exc

    def _failure(self) -> BaseException | None:
        """The failure of a save that has ended, for the library's own bookkeeping (not reported)."""
        return self._future.exception()

    @classmethod
    def skipped(cls, path: str, step: int | None, blocking_s: float) -> SaveHandle:
        """A handle for a save that was skipped (already done, nothing written)."""
        future: cf.Future[SaveStats] = cf.Future()
        future.set_result(SaveStats(path, 0, 0, 0, blocking_s, 0.0, 0.0, blocking_s, step=step, skipped=True))
        return cls(path, future, blocking_s, 0.0, step)

    @property
    def stats(self) -> SaveStats | None:
        """The figures once the save has succeeded, else None."""
        if self._future.done() and self._future.exception() is None:
            return self._future.result()
        return None

    def __repr__(self) -> str:
        if not self.done():
            state = "running"
        elif self._future.exception() is not None:
            state = "failed"
        else:
            state = "skipped" if self._future.result().skipped else "committed"
        return f"<SaveHandle {self.path} {state}>"
