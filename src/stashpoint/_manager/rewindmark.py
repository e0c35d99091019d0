"""A rewind the remote tier has not seen yet, kept in the local root until an upload applies it.

A save that goes back below the run's highest step moves the abandoned run's steps aside in
both tiers. Where the remote tier cannot be listed then (unreachable at the restore, or at the
save), its steps above the rewind stay, and a restart would take the highest of them and resume
the abandoned run. So the rewind is written down in the local root
(``.stashpoint-rewind.json``: the step gone back to), restores pass by the remote steps above
it, and every upload tries to move them aside before it copies anything; the first that does
removes the mark. While the mark stands no step of the new run has reached the remote tier
(each upload applies the mark first), so every remote step above it is the abandoned run's.
"""

from __future__ import annotations

import json
import logging

from stashpoint._core.naming import REWIND_NAME
from stashpoint._storage import Storage
from stashpoint.errors import CheckpointError

log = logging.getLogger("stashpoint")

_MAX_BYTES = 256


def pending_rewind(local: Storage) -> int | None:
    """The step of a rewind whose remote steps above are not yet set aside, or None."""
    try:
        raw = local.read(REWIND_NAME, 0, _MAX_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, CheckpointError) as e:
        log.warning("stashpoint: the rewind mark %s/%s cannot be read (%s)", local.location, REWIND_NAME, e)
        return None
    try:
        above = json.loads(raw)["above"]
        if type(above) is not int or not -1 <= above < 2**62:
            raise ValueError(above)
    except (ValueError, TypeError, KeyError):
        log.warning("stashpoint: %s/%s is no rewind mark of ours; it is ignored", local.location, REWIND_NAME)
        return None
    return above


def mark_rewind(local: Storage, above: int) -> None:
    """Write down that the remote steps above ``above`` belong to a run gone back from. A mark
    already there for a lower step stays: its steps are the older run's too."""
    before = pending_rewind(local)
    if before is not None and before <= above:
        return
    local.commit(REWIND_NAME, json.dumps({"above": above}).encode())


def clear_rewind(local: Storage) -> None:
    """The remote steps above the mark are set aside: the mark goes."""
    try:
        local.delete(REWIND_NAME)
    except FileNotFoundError:
        pass
    except OSError as e:  # the next upload moves nothing more (nothing is above) and tries again
        log.warning("stashpoint: could not remove the rewind mark in %s: %s", local.location, e)


def live(remote_steps: list[int], above: int | None) -> list[int]:
    """The remote steps a restore may take: not those of a run gone back from."""
    return remote_steps if above is None else [s for s in remote_steps if s <= above]
