"""A rewind the remote tier has not seen yet, kept in the local root until an upload applies it.

A save that goes back below the run's highest step moves the abandoned run's steps aside in
both tiers. Where the remote tier cannot be listed then (unreachable at the restore, or at the
save), its steps above the rewind stay, and a restart would take the highest of them and resume
the abandoned run. So the rewind is written down in the local root (``.stashpoint-rewind.json``:
the step gone back to, the remote tier and the time), restores pass by the remote steps above
it that were committed before it, and every upload tries to move those aside before it copies
anything; the first that does removes the mark. The time keeps a mark that outlived its
purpose (it could not be removed, or a node-local job's rank 0 came back to a node that held
it) from ever taking a step the new run uploaded: those were committed after it.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
from dataclasses import dataclass

from stashpoint._core.naming import REWIND_NAME, step_dir
from stashpoint._load.manifest import read_head
from stashpoint._storage import Storage
from stashpoint.errors import CheckpointError

log = logging.getLogger("stashpoint")

_MAX_BYTES = 4096
_SKEW = _dt.timedelta(minutes=10)  # hosts' clocks may differ by this much


@dataclass(frozen=True)
class Rewind:
    """The step a run went back to, on which remote tier, and when (UTC, to the millisecond)."""

    above: int
    remote: str
    at: str

    def abandoned(self, remote: Storage, step: int, local: Storage | None = None) -> bool:
        """Whether the remote ``step`` is the abandoned run's: above the rewind, committed before
        it, and not the save the local root holds under that number (the abandoned run's local
        steps were set aside, so that one is the new run's). One whose manifest cannot be read
        counts too: it is moved, not lost."""
        if step <= self.above:
            return False
        try:
            head = read_head(remote.child(step_dir(step)), remember=False)
        except (OSError, CheckpointError):
            return True
        if local is not None:
            try:
                if read_head(local.child(step_dir(step)), remember=False).save_id == head.save_id:
                    return False
            except (OSError, CheckpointError):
                pass  # not there (the retention took it), or not readable now: the time decides
        try:  # manifests are stamped to the millisecond (older ones to the second: earlier still)
            return _dt.datetime.fromisoformat(head.created) < _dt.datetime.fromisoformat(self.at)
        except (ValueError, TypeError):
            return True


def pending_rewind(local: Storage, remote: str) -> Rewind | None:
    """The rewind written down in ``local`` for the remote tier at ``remote``, or None."""
    try:
        raw = local.read(REWIND_NAME, 0, _MAX_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, CheckpointError) as e:
        log.warning("stashpoint: the rewind mark %s/%s cannot be read (%s)", local.location, REWIND_NAME, e)
        return None
    try:
        doc = json.loads(raw)
        mark = Rewind(doc["above"], doc["remote"], doc["at"])
        if type(mark.above) is not int or not 0 <= mark.above < 2**62 or not isinstance(mark.remote, str):
            raise ValueError(mark)
        at = _dt.datetime.fromisoformat(mark.at)
        if at.tzinfo is None:
            raise ValueError(mark.at)
        if at > _dt.datetime.now(_dt.timezone.utc) + _SKEW:  # it would take every remote step saved until then
            log.warning(
                "stashpoint: the rewind mark in %s is dated %s, in the future; it is ignored (check this host's clock)",
                local.location,
                mark.at,
            )
            return None
    except (ValueError, TypeError, KeyError, RecursionError):
        log.warning("stashpoint: %s/%s is no rewind mark of ours; it is ignored", local.location, REWIND_NAME)
        return None
    if mark.remote != remote:
        log.warning(
            "stashpoint: the rewind mark in %s is for the remote tier %s, not %s; it is ignored",
            local.location,
            mark.remote,
            remote,
        )
        return None
    return mark


def mark_rewind(local: Storage, mark: Rewind) -> None:
    """Write ``mark`` down, over any other: a rewind still pending is merged into ``mark`` by its
    uploader, and one that was applied must not lend its lower step to the new time."""
    local.commit(REWIND_NAME, json.dumps({"above": mark.above, "remote": mark.remote, "at": mark.at}).encode())


def clear_rewind(local: Storage) -> bool:
    """The remote steps the mark is about are set aside: the mark goes. Whether it went."""
    try:
        local.delete(REWIND_NAME)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("stashpoint: could not remove the rewind mark in %s (%s); tried again", local.location, e)
        return False
    return True


def live(remote_steps: list[int], mark: Rewind | None, remote: Storage, local: Storage) -> list[int]:
    """The remote steps a restore may take: not those of a run gone back from."""
    if mark is None:
        return remote_steps
    return [s for s in remote_steps if not mark.abandoned(remote, s, local)]
