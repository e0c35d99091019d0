"""SaveStats and SaveHandle: what a save reports, and the handle of a save in flight."""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass


@dataclass(frozen=True)
class SaveStats:
    """Figures of one save. Times are in seconds.

    ``bytes_written``, ``num_tensors`` and ``num_files`` describe the whole checkpoint (all ranks
    of a distributed save); ``rank_bytes_written`` is this rank's share. ``blocking_s`` (the
    training stall), ``staging_s`` and ``persist_s`` are this rank's.
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

    @property
    def throughput_gbps(self) -> float:
        """Persist throughput in GB/s (10^9 bytes per second)."""
        return self.bytes_written / self.persist_s / 1e9 if self.persist_s > 0 else float("inf")

    def __str__(self) -> str:
        if self.skipped:
            return f"save of step {self.step} to {self.path} skipped: the previous save was still persisting"
        return (
            f"{self.bytes_written / 1e9:.3f} GB to {self.path}: blocked {self.blocking_s * 1e3:.1f} ms "
            f"(staging {self.staging_s * 1e3:.1f} ms), persisted in {self.persist_s:.2f} s "
            f"({self.throughput_gbps:.2f} GB/s)"
        )


class SaveHandle:
    """A save in progress. The state was staged when this handle was returned."""

    def __init__(
        self, path: str, future: cf.Future[SaveStats], blocking_s: float, staging_s: float, step: int | None = None
    ) -> None:
        self.path = path
        self.step = step
        self._future = future
        self.blocking_s = blocking_s
        self.staging_s = staging_s

    def wait(self, timeout: float | None = None) -> SaveStats:
        """Block until the checkpoint is committed and durable; return its figures.

        Raises :class:`CheckpointError` (with the path and the cause) if the background write
        failed, and :class:`TimeoutError` if ``timeout`` seconds pass first.
        """
        try:
            return self._future.result(timeout)
        except cf.TimeoutError:
            raise TimeoutError(f"the save to {self.path} is still running after {timeout} s") from None

    def done(self) -> bool:
        """True once the save has committed or failed."""
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The background failure, or None if the save succeeded (waits like :meth:`wait`)."""
        try:
            return self._future.exception(timeout)
        except cf.TimeoutError:
            raise TimeoutError(f"the save to {self.path} is still running after {timeout} s") from None

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
