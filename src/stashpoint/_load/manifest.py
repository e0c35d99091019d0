"""What is at a path: the validated manifest of a checkpoint, or the clearest error saying what
is there instead (nothing, a file, a run directory, a DCP checkpoint, an unfinished save)."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from stashpoint._core.format import MAX_MANIFEST_BYTES, FileEntry, Manifest, checksum
from stashpoint._core.header import parse_header
from stashpoint._core.index import Head, RankIndex, assemble, parse_head, parse_index
from stashpoint._core.naming import MANIFEST_NAME, looks_like_shard, parse_save_file, parse_step_dir
from stashpoint._core.reshard import Box
from stashpoint._core.sealed import common_fields, open_sealed
from stashpoint._storage import LocalStorage, Storage, storage_for
from stashpoint._storage.oserror import file_kind, is_damage, read_failed
from stashpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)

_TORCH_FILES = (".pt", ".pth", ".bin")
_T = TypeVar("_T")
# Within a restore, what has been parsed (and planned) once: keyed by the very bytes read, so a
# file that changed is parsed anew. None outside one.
_MEMO: ContextVar[dict[Any, Any] | None] = ContextVar("stashpoint_parsed", default=None)


@contextmanager
def remembering() -> Iterator[None]:
    """Within it, this thread parses each distinct manifest and index once, and a load plans a
    state once per checkpoint: a node-local restore reads them in three passes and then loads.
    Every read still reads the file and checks it against the manifest's checksums."""
    token = _MEMO.set({}) if _MEMO.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _MEMO.reset(token)


class IndexMissingError(CorruptCheckpointError):
    """An index the manifest lists is not there: damage, or a node-local run's directory, which
    holds its own node's files only (the message says both)."""


def remembered(key: Any, make: Callable[[], _T]) -> _T:
    """``make()``, or within :func:`remembering` the value it gave for ``key`` (errors are not
    remembered)."""
    memo = _MEMO.get()
    if memo is None:
        return make()
    if key not in memo:
        memo[key] = make()
    return memo[key]  # type: ignore[no-any-return]


def forget(doomed: Callable[[Any], bool]) -> None:
    """Within :func:`remembering`, drop the values whose keys ``doomed`` picks."""
    memo = _MEMO.get()
    for key in [k for k in memo or () if doomed(k)]:
        del memo[key]  # type: ignore[union-attr]


def read_head(storage: Storage, *, remember: bool = True) -> Manifest | Head:
    """Read and validate the manifest of the checkpoint at ``storage``: a version-1 manifest
    whole, a version-2 one as its head (the catalog and the list of indexes). ``remember=False``:
    parsed anew and not kept, even within :func:`remembering` (a look at every step's)."""
    raw = _manifest_bytes(storage)
    where = f"{storage.location}/{MANIFEST_NAME}"
    if not remember:
        return parse_head(raw, where)
    return remembered(("head", raw), lambda: parse_head(raw, where))


def read_summary(storage: Storage) -> dict[str, Any]:
    """The fields of the manifest at ``storage`` every version has (its save id, when it was
    made, its metadata), its seal checked, its catalog not parsed: a listing of many steps of
    many tensors reads these alone."""
    raw = _manifest_bytes(storage)
    where = f"{storage.location}/{MANIFEST_NAME}"
    return common_fields(open_sealed(raw, where)[0], where)


def _manifest_bytes(storage: Storage) -> bytes:
    loc = storage.location
    try:
        root = storage.root if isinstance(storage, LocalStorage) else None
        what = _not_a_directory(root) if root is not None else None
        if root is not None and what is not None:
            hint = (
                "convert it with: stashpoint import SRC PATH"
                if what == "a file" and root.suffix in _TORCH_FILES
                else "give the checkpoint's directory"
            )
            raise CheckpointError(f"{loc} is {what}, not a stashpoint checkpoint directory; {hint}")
        if storage.size(MANIFEST_NAME) > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(f"the manifest of {loc} is larger than the {MAX_MANIFEST_BYTES} byte cap")
        raw = storage.read(MANIFEST_NAME, 0, MAX_MANIFEST_BYTES + 1)  # bounded: it may grow after the size
    except FileNotFoundError:
        _no_manifest(storage)
    except OSError as e:
        raise read_failed(f"the manifest of {loc}", e) from None
    return raw


def _not_a_directory(path: Path) -> str | None:
    """What ``path`` is where it is no directory (a file, a FIFO, a device, a link loop): the
    path given was never a checkpoint, which says nothing of damage. None: a directory, or none."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        return "a loop of symbolic links" if e.errno == errno.ELOOP else None
    if stat.S_ISDIR(mode):
        return None
    return "a file" if stat.S_ISREG(mode) else f"a {file_kind(mode)}"


def read_index(storage: Storage, head: Head, rank: int) -> RankIndex:
    """Rank ``rank``'s index of the checkpoint ``head`` commits, checked against the size and
    checksum the manifest records for it."""
    name = head.index_name(rank)
    where = f"{storage.location}/{name}"
    size, sums = head.indexes[rank]
    try:
        actual = storage.size(name)
        if actual != size:
            raise CorruptCheckpointError(f"index {where} is {actual} bytes, the manifest says {size}")
        raw = storage.read(name, 0, size + 1)  # bounded: a file swapped in after the size may be any size
    except FileNotFoundError:
        raise IndexMissingError(
            f"index {where} listed in the manifest is missing (one node's directory of a node_local=True run "
            "holds its own ranks' files only: restore it with that CheckpointManager, check its part with "
            "stashpoint verify --this-node, or gather every node's files of the step into one directory)"
        ) from None
    except OSError as e:
        raise read_failed(f"index {where}", e) from None
    if len(raw) != size or checksum(raw) != sums:
        raise CorruptCheckpointError(f"index {where} does not match the manifest's checksum (damaged, or replaced)")
    # the head is held by the memo's value, so its id is not reused while it is remembered
    return remembered(("index", id(head), rank, raw), lambda: (head, parse_index(raw, where, head, rank)))[1]


def writers_of(head: Head, regions: Iterable[tuple[str, Box]]) -> set[int]:
    """The ranks whose indexes describe the stored chunks overlapping ``regions`` ((key, region)
    pairs of stored, not aliased, keys): one step per chunk found."""
    ranks: set[int] = set()
    for key, region in regions:
        p = head.catalog.get(key)
        if p is not None:
            ranks.update(w for _, w in p.overlapping(region))
    return ranks


def read_view(
    storage: Storage, head: Head, ranks: Iterable[int], tree_rank: int, have: dict[int, RankIndex] | None = None
) -> Manifest:
    """The checkpoint as the indexes of ``ranks`` (and ``tree_rank``'s, whose tree it carries) see it.
    ``have``: indexes already read, reused and completed with those read here."""
    have = {} if have is None else have
    for r in sorted({*ranks, tree_rank} - have.keys()):
        have[r] = read_index(storage, head, r)
    return assemble(head, {r: have[r] for r in sorted({*ranks, tree_rank})}, tree_rank)


def read_manifest(storage: Storage) -> Manifest:
    """The whole checkpoint at ``storage``: a version-2 one with every rank's index read (for
    the tools; loads read only the indexes they need)."""
    head = read_head(storage)
    if isinstance(head, Manifest):
        return head
    return assemble(head, {r: read_index(storage, head, r) for r in range(head.world_size)})


def open_checkpoint(path: str | os.PathLike[str] | Storage) -> tuple[Storage, Manifest]:
    """The storage and validated manifest of the checkpoint at ``path`` (a directory or URL),
    for the tools: damage is named as such."""
    storage = storage_for(path)
    try:
        return storage, read_manifest(storage)
    except IndexMissingError:
        raise  # its message says both causes: damage, or one node's directory of a node-local run
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{e} (the checkpoint is damaged: use an earlier one or a copy)") from None


def as_changed(error: CheckpointError, storage: Storage, save_id: str | None) -> CheckpointError:
    """``error``, or where a file the checkpoint lists was missing or not its own because the
    checkpoint was deleted (a manager's retention) or replaced (``overwrite=True``) while it was
    read, an error that says so: it is no damage to look for (a load that raised may still have
    changed the state, as its message says)."""
    if not isinstance(error, CorruptCheckpointError):
        return error
    try:
        if not storage.exists(MANIFEST_NAME):
            return CheckpointNotFoundError(
                f"{storage.location} was deleted while it was read (a CheckpointManager's retention deletes old "
                f"steps): load a checkpoint that is still there. {error}"
            )
        if save_id is not None and read_summary(storage)["save_id"] != save_id:
            return CheckpointError(
                f"{storage.location} was replaced by another save (overwrite=True) while it was read: read it "
                f"again. {error}"
            )
    except (OSError, CheckpointError):  # cannot tell now: the error found stands
        pass
    return error


def _no_manifest(storage: Storage) -> NoReturn:
    loc = storage.location.rstrip("/")
    try:
        there = storage.exists(None)
        names = storage.list() + storage.children() if there else []
    except OSError as e:
        raise read_failed(f"the directory {loc}", e) from None
    if not there:
        raise CheckpointNotFoundError(f"no checkpoint at {loc}: the path does not exist (check the spelling)")
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
    listed = {f.name for f in manifest.files} | {name for name, _ in manifest.indexes}
    own = (n for n in storage.list() if (p := parse_save_file(n)) is not None and p[1] == manifest.save_id)
    return sorted(n for n in own if n not in listed)


def shard_where(storage: Storage, manifest: Manifest, name: str) -> str:
    """How errors name a shard: its location and (some of) the keys it holds (a scan of the
    manifest: for error messages only)."""
    keys = sorted(manifest.keys_by_file.get(name, ()))
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
        if not is_damage(e):  # permissions, limits: not a problem of the checkpoint's
            raise read_failed(f"shard {shard_where(storage, manifest, fe.name)}", e) from None
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
        if not is_damage(e):
            raise read_failed(f"the header of shard {where}", e) from None
        return f"reading the header of shard {where} failed: {e.strerror or e}", True
    if not isinstance(meta, dict) or meta.get("save_id") != manifest.save_id:
        return f"shard {shard_where(storage, manifest, fe.name)} belongs to another save than its manifest", True
    return None, True
