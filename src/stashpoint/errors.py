"""The exception hierarchy of stashpoint.

Every error raised on purpose by stashpoint derives from :class:`CheckpointError`, and its
message names the key, path or value at fault and says how to fix it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "ReplicaError",
    "S3Error",
    "StateMismatchError",
    "UnsupportedStateError",
]


class CheckpointError(Exception):
    """Base class of every error stashpoint raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint exists at the given path (also a :class:`FileNotFoundError`)."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's bytes are damaged: checksum mismatch, truncation, malformed header or manifest."""


class IncompleteCheckpointError(CheckpointError):
    """The path exists but the save that created it never committed (no manifest), or, in a
    node-local manager's restore, some of the step's files are on no node of the job."""


class S3Error(CheckpointError, OSError):
    """An S3 request failed for good: the message names the URL, what the server said and the fix."""


class ReplicaError(CheckpointError):
    """A step committed on every node, but copying it to other nodes (``replicas``) failed: the
    step is loadable, and a node lost now takes its files of the step with it."""


class UnsupportedStateError(CheckpointError, TypeError):
    """The state holds a value stashpoint cannot save without pickling."""


class StateMismatchError(CheckpointError):
    """The checkpoint and the state to load into disagree.

    Every problem is listed, not only the first; they are also available as :attr:`problems`.
    """

    def __init__(self, path: str, problems: Sequence[str], *, hint: str | None = None) -> None:
        self.path = path
        self.problems = list(problems)
        self.hint = hint
        shown = "\n  - ".join(self.problems[:50])
        more = f"\n  ... and {len(self.problems) - 50} more" if len(self.problems) > 50 else ""
        super().__init__(
            f"the state does not match the checkpoint at {path} "
            f"({len(self.problems)} problem(s)):\n  - {shown}{more}\n"
            + (f"Likely cause: {hint}.\n" if hint else "")
            + "Fix the state to match, or pass strict=False to load what matches and skip the rest."
        )

    def __reduce__(self) -> tuple[object, ...]:
        # pickle would call the class with the message alone: a process pool or a spawned
        # worker handing the error back would fail with a TypeError in its place
        return (_rebuilt, (type(self), self.args), self.__dict__)


def _rebuilt(cls: type[StateMismatchError], args: tuple[object, ...]) -> StateMismatchError:
    return BaseException.__new__(cls, *args)  # sets args; the attributes come from the pickled state
