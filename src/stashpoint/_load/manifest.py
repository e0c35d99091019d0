"""What is at a path: the validated manifest of a checkpoint, or the clearest error saying what
is there instead (nothing, a file, a run directory, a DCP checkpoint, an unfinished save)."""

from __future__ import annotations

import os
from typing import NoReturn

from stashpoint._core.format import MAX_MANIFEST_BYTES, FileEntry, Manifest, checksum, parse_manifest
from stashpoint._core.header import parse_header
from stashpoint._core.naming import MANIFEST_NAME, looks_like_shard, parse_shard_name, parse_step_dir
from stashpoint._storage import LocalStorage, Storage, storage_for
from stashpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)

_TORCH_FILES = (".pt", ".pth", ".bin")


def read_manifest(storage: Storage) -> Manifest:
    """Read and validate the manifest of the checkpoint at ``storage``."""
    loc = storage.location
    if isinstance(storage, LocalStorage) and storage.root.is_file():
        hint = (
            "convert it with: stashpoint import SRC PATH"
            if storage.root.suffix in _TORCH_FILES
            else "give the checkpoint's directory"
        )
        raise CheckpointError(f"{loc} is a file, not a stashpoint checkpoint directory; {hint}")
    try:
        if storage.size(MANIFEST_NAME) > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(f"the manifest of {loc} is larger than the {MAX_MANIFEST_BYTES} byte cap")
        raw = storage.read(MANIFEST_NAME)
    except FileNotFoundError:
        _no_manifest(storage)
    return parse_manifest(raw, f"{loc}/{MANIFEST_NAME}")


def open_checkpoint(path: str | os.PathLike[str] | Storage) -> tuple[Storage, Manifest]:
    """The storage and validated manifest of the checkpoint at ``path`` (a directory or URL),
    for the tools: damage is named as such."""
    storage = storage_for(path)
    try:
        return storage, read_manifest(storage)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{e} (the checkpoint is damaged: use an earlier one or a copy)") from None


def _no_manifest(storage: Storage) -> NoReturn:
    loc = storage.location.rstrip("/")
    if not storage.exists(None):
        raise CheckpointNotFoundError(f"no checkpoint at {loc}: the path does not exist (check the spelling)")
    names = storage.list() + storage.children()
    steps = sorted(n for n in names if parse_step_dir(n) is not None)
    if steps:
        newest = next((n for n in reversed(steps[-10:]) if storage.child(n).exists(MANIFEST_NAME)), steps[-1])
        raise CheckpointError(
            f"{loc} is a run directory with {len(steps)} step directories, not a checkpoint: pass a step directory, "
            f"e.g. {loc}/{newest} (stashpoint ls {loc} lists them), or use CheckpointManager(...).restore(state)"
        )
    if ".metadata" in names:
        raise CheckpointError(
            f"{loc} is a DCP checkpoint, not a stashpoint one; convert it with: stashpoint import {loc} OUT"
        )
    if names and not any(looks_like_shard(n) or n.startswith(f".{MANIFEST_NAME}") for n in names):
        raise CheckpointError(
            f"{loc} is not a stashpoint checkpoint (no {MANIFEST_NAME} and no shard files); check the path"
        )
    if not names:
        raise IncompleteCheckpointError(
            f"{loc} is empty, not a stashpoint checkpoint (no {MANIFEST_NAME}): a save that did not finish, "
            "or the wrong path"
        )
    raise IncompleteCheckpointError(
        f"{loc} exists but holds no committed checkpoint (no {MANIFEST_NAME}): the save that "
        "wrote it did not finish. Load an earlier checkpoint, or delete this directory."
    )


def unlisted_shards(storage: Storage, manifest: Manifest) -> list[str]:
    """Shard files of *this* save that its manifest does not list: the manifest lost entries.

    (Shards of other saves — leftovers of an interrupted overwrite — are not part of the
    checkpoint and do not count.)"""
    listed = {f.name for f in manifest.files}
    own = (n for n in storage.list() if (p := parse_shard_name(n)) is not None and p[2] == manifest.save_id)
    return sorted(n for n in own if n not in listed)


def shard_where(storage: Storage, manifest: Manifest, name: str) -> str:
    """How errors name a shard: its location and (some of) the keys it holds (a scan of the
    manifest: for error messages only)."""
    keys = sorted({k for k, e in manifest.tensors.items() if any(c.file == name for c in e.chunks)})
    shown = ", ".join(repr(k) for k in keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    return f"{storage.location}/{name} (holding {shown or 'no tensor'})"


def shard_problem(storage: Storage, manifest: Manifest, fe: FileEntry) -> tuple[str | None, bool]:
    """What is wrong with shard ``fe`` before its data is read — missing, not a regular file,
    another size, a header from another save — and whether its data can be read at all."""
    where = f"{storage.location}/{fe.name}"  # the parser's messages; ours name the keys too
    try:
        size = storage.size(fe.name)
    except FileNotFoundError:
        return f"shard {shard_where(storage, manifest, fe.name)} listed in the manifest is missing", False
    except CorruptCheckpointError as e:  # not a regular file
        return str(e), False
    except OSError as e:
        return f"shard {shard_where(storage, manifest, fe.name)} is refused: {e.strerror or e}", False
    if size != fe.size:
        what = "truncated" if size < fe.size else "larger than recorded"
        held = shard_where(storage, manifest, fe.name)
        return f"shard {held} is {what}: {size} bytes, the manifest says {fe.size}", True
    try:
        head = storage.read(fe.name, 0, fe.data_start)
        if checksum(head) != fe.header_checksum:
            held = shard_where(storage, manifest, fe.name)
            return f"the header of shard {held} does not match the manifest (damaged, or from another save)", True
        meta = parse_header(head, size, where).get("__metadata__", {})
    except CorruptCheckpointError as e:
        return str(e), True
    except OSError as e:
        return f"reading the header of shard {where} failed: {e.strerror or e}", True
    if not isinstance(meta, dict) or meta.get("save_id") != manifest.save_id:
        return f"shard {shard_where(storage, manifest, fe.name)} belongs to another save than its manifest", True
    return None, True
