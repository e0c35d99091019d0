"""``torch.distributed.destroy_process_group()`` waits for this process's saves in flight.

A training script often ends with ``dist.destroy_process_group()`` right after its last
``async_save`` or ``mgr.save``: destroying every group takes stashpoint's own gloo group with
it, so the save in flight failed, its checkpoint was lost and the job still exited 0 (in one
process, exiting without ``wait()`` commits it: the interpreter's exit waits). The first
distributed save wraps the function so that destroying the default group, or every group,
waits for those saves first, and for the uploads of open managers to their remote tier; a
save's failure stays with its handle, as without the wrapper.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger("stashpoint")


class _Pending(Protocol):
    def pending_futures(self) -> list[cf.Future[Any]]: ...


_watched: weakref.WeakSet[_Pending] = weakref.WeakSet()  # work beside the saves: a manager's uploads


def watch(work: _Pending) -> None:
    """Have the wrapped ``destroy_process_group`` wait for ``work.pending_futures()`` too (while
    ``work`` lives): a manager's uploads run on stashpoint's own groups, which it destroys."""
    _watched.add(work)


_saves: list[Callable[[], list[cf.Future[Any]]]] = []
# how long destroy waits for uploads: one whose peer never runs it would hold the program for
# the upload group's hour; its step stays in the local root for the next manager to upload
UPLOAD_WAIT_S = 600.0


def install(saves: Callable[[], list[cf.Future[Any]]] | None = None) -> None:
    """Wrap ``torch.distributed.destroy_process_group`` (once per process) to wait first for
    the futures ``saves()`` gives (and every such function installed), then for the watched
    uploads."""
    import torch.distributed as dist

    if saves is not None and saves not in _saves:
        _saves.append(saves)
    original = dist.destroy_process_group
    if getattr(original, "_stashpoint_waits", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group: Any = None, *args: Any, **kwargs: Any) -> Any:
        if group is None or group is getattr(dist.GroupMember, "WORLD", None):
            wait_for([f for fn in list(_saves) for f in fn()])  # the saves first: uploads queue behind them
            wait_for([f for w in list(_watched) for f in w.pending_futures()], UPLOAD_WAIT_S)
        return original(group, *args, **kwargs)

    destroy_process_group._stashpoint_waits = True  # type: ignore[attr-defined]
    dist.destroy_process_group = destroy_process_group


def wait_for(pending: list[cf.Future[Any]], timeout: float | None = None) -> None:
    """Wait until the saves (or uploads) of ``pending`` have ended, or ``timeout`` passed."""
    if pending:
        log.info(
            "stashpoint: waiting for %d save(s) or upload(s) in flight before destroy_process_group()",
            len(pending),
        )
        left = cf.wait(pending, timeout=timeout).not_done
        if left:
            log.warning(
                "stashpoint: destroying the process groups after waiting %.0f s for %d upload(s); their steps stay "
                "in the local root and are uploaded when a manager opens it again",
                timeout,
                len(left),
            )
