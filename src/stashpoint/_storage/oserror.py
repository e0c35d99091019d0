"""What a failed read of a checkpoint's file says about the checkpoint.

Some failures of the operating system say the copy is damaged or gone (an I/O error, a file
missing or replaced by a directory or a symbolic link loop): a restore may then fall back to
an older copy and set this one aside. Others say only that it cannot be read here and now
(permissions, the open-file limit, memory, a network file system gone away): the copy may be
the newest good one, so nothing is set aside and no older step is loaded in its place. Where
the two cannot be told apart (``ENODATA`` of a file a hierarchical store released, ``ENXIO`` of
a device gone), the error is taken for the second kind: a good step is never set aside for it.
"""

from __future__ import annotations

import errno
import stat
from pathlib import Path

from stashpoint.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError

_DAMAGE = frozenset(
    {
        errno.ENOENT,
        errno.EIO,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.ELOOP,
        errno.EBADMSG,
        getattr(errno, "EUCLEAN", 117),  # "structure needs cleaning": the file system found damage
    }
)


def is_damage(e: OSError) -> bool:
    """Whether ``e`` says the file read is damaged or gone (not that it cannot be read now)."""
    return e.errno in _DAMAGE


def says_damage(e: BaseException) -> bool:
    """Whether any error says a checkpoint's copy is damaged or gone, so that a restore may fall
    back past it: stashpoint's own corrupt or incomplete errors, a file that ended early, an OS
    error of the damage kind. Every place that sorts failures asks this, so ranks agree."""
    if isinstance(e, (CorruptCheckpointError, IncompleteCheckpointError, EOFError)):
        return True
    return isinstance(e, OSError) and not isinstance(e, CheckpointError) and is_damage(e)


def read_failed(what: str, e: OSError) -> CheckpointError:
    """The error of a failed read of ``what`` (a file, named by its path): a
    :class:`CorruptCheckpointError` where ``e`` says the copy is damaged or gone, otherwise a
    plain :class:`CheckpointError` that says the copy was left alone and names the fix. An
    error that is a :class:`CheckpointError` already (S3's, which name their fix) is kept."""
    if isinstance(e, CheckpointError):
        return e
    reason = e.strerror or str(e) or type(e).__name__
    if e.filename and str(e.filename) not in what:
        what = f"{what} ({e.filename})"
    if is_damage(e):
        return CorruptCheckpointError(f"reading {what} failed: {reason}")
    code = f" ({errno.errorcode[e.errno]})" if e.errno is not None and e.errno in errno.errorcode else ""
    return CheckpointError(
        f"reading {what} failed: {reason}{code}. This does not say the checkpoint is damaged, so it is "
        "neither set aside nor passed over for an older one: fix the cause (the files' permissions, the "
        "open-file limit, the storage's reachability) and load again"
    )


def file_kind(mode: int) -> str:
    """What a ``st_mode`` that is no regular file names: a link, a directory, a FIFO, ..."""
    for test, kind in ((stat.S_ISLNK, "symbolic link"), (stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO")):
        if test(mode):
            return kind
    return "special file"


def not_regular(path: Path, kind: str) -> CorruptCheckpointError:
    """A checkpoint's file that is no regular file (a FIFO, a link, ...): refused, named."""
    return CorruptCheckpointError(
        f"{path} is a {kind}, not a regular file; a checkpoint holds only regular files, so it is refused "
        "(remove it, or load an earlier checkpoint)"
    )
