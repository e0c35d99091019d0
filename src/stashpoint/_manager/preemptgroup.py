"""The gloo group the ranks tell each other of a preemption signal on: one per process, kept
for every manager that handles preemption, created when the managers open, with every rank's
arrival marked first so that one that never comes is named."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from stashpoint._dist import group as _dist
from stashpoint._dist.arrival import CollectiveError, all_came, came, store
from stashpoint._dist.gloo import gloo_group

log = logging.getLogger("stashpoint")

_opened = 0
_WHAT = "create the preemption group of their CheckpointManagers"
_HINT = (
    "every rank creates its CheckpointManager with preemption_deadline at the same point: did the constructor "
    "raise on those ranks, or are they gone?"
)


_GROUP_TIMEOUT_S = 1800.0  # ranks may reach maybe_save minutes apart (torch's default timeout)


def signal_context() -> _dist.DistContext:
    """The process's preemption group, kept for every manager that handles preemption (one at a
    time) and destroyed by ``shutdown()``. Every rank marks its arrival first, group made or
    not: rank 0 names the ranks that never come (a constructor that raised on them) after 30 s."""
    import torch.distributed as dist

    global _opened
    made = _opened + 1  # alike on every rank: each creates its managers in the same order (counted once made)
    mark = f"stashpoint/preemption/{made}"
    all_came(store(), mark, dist.get_rank(), dist.get_world_size(), _dist.DEFAULT_TIMEOUT_S, _WHAT, _HINT)
    ctx = _dist.world_context("preemption", _signal_group, _GROUP_TIMEOUT_S)
    came(store(), mark, dist.get_rank())
    _opened = made
    return ctx


def _signal_group() -> Any:
    """The group the ranks tell each other of a signal on: created under stashpoint's timeout (a
    rank preempted while the managers open is waited for that long, not half an hour), then
    given torch's default of 30 minutes, as ranks may reach maybe_save minutes apart."""
    import torch.distributed as dist

    try:
        group = gloo_group(timeout=timedelta(seconds=_dist.DEFAULT_TIMEOUT_S))
        dist.barrier(group=group)  # a lazy group (at scale) waits for no rank until its first collective
    except Exception as e:
        raise CollectiveError(
            f"could not create the preemption group over every rank within {_dist.DEFAULT_TIMEOUT_S:.0f} s (every "
            f"rank creates its CheckpointManager at the same point; is one gone?): {type(e).__name__}: {str(e)[:300]}"
        ) from e
    try:
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(timedelta(seconds=_GROUP_TIMEOUT_S), group)
    except Exception as e:  # a torch without it: a signal check waits the creation's timeout
        log.debug("stashpoint: the preemption group keeps its %.0f s timeout (%s)", _dist.DEFAULT_TIMEOUT_S, e)
    return group
