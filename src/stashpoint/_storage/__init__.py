"""Where checkpoints are stored: one small interface (:class:`Storage`), the local backend and
S3; :func:`storage_for` picks the backend for a path by its scheme."""

from __future__ import annotations

import errno
import importlib
import os
from pathlib import Path

from stashpoint._storage.base import FileWriter, Storage, env_number
from stashpoint._storage.local import LocalStorage, user_path
from stashpoint.errors import CheckpointError

# scheme -> (module, class): backends are imported only when a path needs them
SCHEMES: dict[str, tuple[str, str]] = {"s3": ("stashpoint._storage.s3", "S3Storage")}

__all__ = [
    "FileWriter",
    "LocalStorage",
    "Storage",
    "env_number",
    "path_problem",
    "same_place",
    "storage_for",
    "user_path",
]


def storage_for(path: str | os.PathLike[str] | Storage) -> Storage:
    """The storage backend for a user-given path. A local directory's knobs come from
    ``STASHPOINT_DIRECT_IO`` (1, or 0 for buffered I/O) and ``STASHPOINT_WRITE_STREAMS`` (shard
    files written at once, default 2); S3's from the ``STASHPOINT_S3_*`` variables."""
    if isinstance(path, Storage):
        return path
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str, os.PathLike or Storage, got {type(path).__name__}")
    text = os.fspath(path)
    if not text:
        raise ValueError("the checkpoint path is empty; give a directory (e.g. 'ckpt/step-100') or an s3:// URL")
    if "://" in text:
        scheme = text.split("://", 1)[0]
        if scheme in SCHEMES:
            module, name = SCHEMES[scheme]
            backend: type[Storage] = getattr(importlib.import_module(module), name)
            return backend(text)  # type: ignore[call-arg]
        raise ValueError(f"unsupported storage scheme {scheme!r} in {text!r}; use a local path or s3://bucket/prefix")
    scheme, colon, rest = text.partition(":/")
    if colon and scheme.lower() in SCHEMES:  # pathlib made "s3:/b/k" of "s3://b/k": not a local directory "s3:"
        raise ValueError(
            f"{text!r} looks like an {scheme}:// URL that lost a slash (pathlib's Path joins give {scheme}:/...); "
            f"join URLs as strings, e.g. f'{scheme.lower()}://{rest}'"
        )
    text = user_path(text)
    try:
        if Path(text).is_symlink() and Path(text).is_dir():
            # the user's own link to a directory (runs -> /scratch/...): followed here, once; links
            # found inside a checkpoint or run directory are never followed
            text = str(Path(text).resolve())
    except OSError as e:  # a name longer than the file system allows (ENAMETOOLONG), a loop of links
        raise CheckpointError(f"{text!r} cannot be a checkpoint path: {path_problem(e)}") from e
    return LocalStorage(
        text,
        direct_io=env_number("STASHPOINT_DIRECT_IO", 1, 0, 1) == 1,
        write_streams=int(env_number("STASHPOINT_WRITE_STREAMS", 2, 1, 64)),
    )


def same_place(a: str, b: str) -> bool:
    """Whether two storages' locations are one checkpoint: local paths compared with their links
    and ``..`` resolved (``runs/ck`` and ``/scratch/ck`` behind a link are one directory)."""
    if a == b:
        return True
    if "://" in a or "://" in b:
        return False
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except (OSError, ValueError):
        return False


def path_problem(e: OSError) -> str:
    """What is wrong with a path the file system refused outright, and what to do."""
    if e.errno == errno.ENAMETOOLONG:
        return "a name in it, or the whole path, is longer than the file system allows; choose a shorter path"
    return f"{e.strerror or e}"
