"""Two storage tiers: each step commits to fast local storage, then is copied to a remote one.

The :class:`Uploader` copies committed steps in the background, one at a time and in the order
they were saved, on a thread of its own with a checkpoint process group of its own (so uploads
never share a group with saves). In a distributed run every rank uploads the shard files it
wrote; once all of them are in place, rank 0 writes the remote manifest last: the remote copy
commits exactly as a save does, and a crash mid-upload leaves only a leftover that the next
manager removes.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import _dist
from ._dist import CollectiveError, DistContext
from ._format import MANIFEST_NAME
from ._load import read_manifest
from ._policy import step_dir
from ._steps import committed_steps, quietly
from ._storage import Storage
from .errors import CheckpointError

log = logging.getLogger("stashpoint")

COPY_BLOCK = 64 * 1024 * 1024


def copy_file(src: Storage, dst: Storage, name: str, size: int) -> None:
    """Copy the file ``name`` of ``size`` bytes from ``src`` to ``dst`` in large blocks."""
    writer = dst.open_writer(name, size)
    try:
        pos = 0
        while pos < size:
            block = src.read(name, pos, min(COPY_BLOCK, size - pos))
            if not block:
                raise EOFError(f"{src.location}/{name} ended at byte {pos} of {size}")
            writer.write(block)
            pos += len(block)
        writer.close()
    except BaseException:
        writer.abort()
        raise


def restore_order(local: Sequence[int], remote: Sequence[int], step: int | None) -> list[tuple[int, str]]:
    """The copies a restore tries, in order: ``(step, "local" | "remote")``.

    Newest step first; for each step the local copy (when every rank has it) before the remote
    one. With ``step`` given, only that step's copies.
    """
    steps = sorted(set(local) | set(remote), reverse=True) if step is None else [step]
    order = []
    for s in steps:
        if s in local:
            order.append((s, "local"))
        if s in remote:
            order.append((s, "remote"))
    return order


class Uploader:
    """Copies steps from ``local`` to ``remote`` (two run roots) in the background, in order.

    Create it on every rank at the same point (it may create a process group); submit the same
    steps on every rank in the same order.
    """

    def __init__(
        self,
        local: Storage,
        remote: Storage,
        *,
        process_group: Any = None,
        timeout_s: float | None = None,
        on_uploaded: Callable[[int], None] | None = None,
    ) -> None:
        self.local = local
        self.remote = remote
        self.on_uploaded = on_uploaded
        self.ctx = _dist.context(process_group, timeout_s, purpose="upload") or DistContext.solo()
        self._executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="stashpoint-upload")
        self._broken: CollectiveError | None = None

    def submit(self, step: int, after: cf.Future[Any] | None = None) -> cf.Future[bool]:
        """Upload ``step`` once ``after`` (its local save) has succeeded; the future tells whether
        a copy was made (False: the save failed, so there was nothing to upload)."""
        return self._executor.submit(self._upload, step, after)

    def catch_up(self, steps: Callable[[], list[int]]) -> cf.Future[list[int]]:
        """Upload the local steps (``steps()`` on rank 0) that the remote tier lacks: those a
        crash or a failed upload left behind."""
        return self._executor.submit(self._catch_up, steps)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)

    def _catch_up(self, steps: Callable[[], list[int]]) -> list[int]:
        todo: list[int] = []
        if self.ctx.rank == 0:
            remote = set(committed_steps(self.remote))
            todo = [s for s in steps() if s not in remote]
        todo = self.ctx.broadcast("steps to upload", todo)
        done = []
        for s in todo:
            try:
                if self._upload(s, None):
                    done.append(s)
            except CheckpointError as e:
                log.error("stashpoint: %s", e)
        return done

    def _upload(self, step: int, after: cf.Future[Any] | None) -> bool:
        if self._broken is not None:
            raise CheckpointError(
                f"step {step} was not uploaded: the ranks lost each other in an earlier upload ({self._broken}); "
                "it is uploaded when a manager opens this root again"
            )
        ctx = self.ctx
        src = self.local.child(step_dir(step))
        dst = self.remote.child(step_dir(step))
        t0 = time.perf_counter()
        # 1. agree that there is something to upload (every rank saw its save succeed)
        status: tuple[str, Any] = ("ok", None)
        if after is not None and (after.cancelled() or after.exception() is not None):
            status = ("skip", "the save failed")
        elif ctx.rank == 0:
            try:
                manifest = read_manifest(src)
                files = [(f.name, f.size, f.rank) for f in manifest.files]
                status = ("done", None) if dst.exists(MANIFEST_NAME) else ("ok", files)
            except (CheckpointError, OSError) as e:
                status = ("error", f"{type(e).__name__}: {e}")
        statuses = self._gather("upload start", status)
        if any(s[0] == "skip" for s in statuses):
            return False
        if statuses[0][0] == "done":
            return True
        if statuses[0][0] == "error":
            raise CheckpointError(f"uploading step {step} to {dst.location} failed: {statuses[0][1]}")
        files = statuses[0][1]
        # 2. every rank copies the files it wrote
        outcome: tuple[str, Any] = ("ok", 0)
        try:
            dst.prepare()
            nbytes = 0
            for name, size, rank in files:
                if rank % ctx.world == ctx.rank:
                    copy_file(src, dst, name, size)
                    nbytes += size
            dst.sync()
            outcome = ("ok", nbytes)
        except Exception as e:
            outcome = ("error", f"rank {ctx.rank}: {type(e).__name__}: {e}")
        outcomes = self._gather("upload outcomes", outcome)
        failed = [o[1] for o in outcomes if o[0] == "error"]
        # 3. rank 0 commits the remote copy: its manifest goes last
        result = None
        if not failed and ctx.rank == 0:
            try:
                dst.commit(MANIFEST_NAME, src.read(MANIFEST_NAME))
            except Exception as e:
                result = f"rank 0: writing the manifest: {type(e).__name__}: {e}"
        try:
            result = ctx.broadcast("upload commit", result)
        except CollectiveError as e:
            self._broken = e
            _dist.forget(ctx)
            raise
        if failed or result is not None:
            if ctx.rank == 0 and not dst.exists(MANIFEST_NAME):
                quietly(dst.remove_tree)  # every rank is done with it
            causes = "; ".join(failed) if failed else str(result)
            raise CheckpointError(
                f"uploading step {step} to {dst.location} failed: {causes}. The local copy at {src.location} is "
                "intact; the step is uploaded again when a manager opens this root next time."
            )
        total = sum(o[1] for o in outcomes)
        seconds = time.perf_counter() - t0
        log.info(
            "stashpoint: uploaded step %d to %s (%.1f MB in %.2f s)", step, dst.location, total / 1e6, seconds
        )
        if self.on_uploaded is not None:
            self.on_uploaded(step)
        return True

    def _gather(self, what: str, obj: Any) -> list[Any]:
        try:
            return self.ctx.all_gather(what, obj)
        except CollectiveError as e:
            self._broken = e
            _dist.forget(self.ctx)
            raise
