"""What the ``stashpoint`` tool commands ls, inspect and verify do, and what the others share.

Pure functions that return data; the click commands in ``_cli`` print it. A bad path or a
checkpoint that cannot be opened raises a :class:`CheckpointError` subclass (a bad argument a
``ValueError``) whose message names the path and the fix. Nothing here unpickles a stashpoint
checkpoint: pickled values are shown as ``<pickled, not loaded>``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from stashpoint._core.dtypes import itemsize
from stashpoint._core.format import Manifest
from stashpoint._core.index import Head, assemble
from stashpoint._core.naming import MANIFEST_NAME, PARTIAL_RE, RECOVERABLE_NAME, REPLICA_RE, parse_shard_name
from stashpoint._core.nodes import Node, decode_plain, join
from stashpoint._core.policy import parse_metrics
from stashpoint._dist.arrival import ranks_text
from stashpoint._load.manifest import IndexMissingError, open_checkpoint, read_head, read_index, read_summary
from stashpoint._manager.runcheck import run_contents
from stashpoint._manager.steps import METRICS_KEY
from stashpoint._storage import LocalStorage, Storage, storage_for, user_path
from stashpoint._storage.oserror import read_failed
from stashpoint.errors import CheckpointError, CheckpointNotFoundError


class Shown(str):
    """A string shown as it is (no quotes) where values are shown by repr: markers like PICKLED."""

    def __repr__(self) -> str:
        return str(self)


PICKLED = Shown("<pickled, not loaded>")
ABSENT = Shown("<absent>")
Progress = Callable[[str], None]

# ---------------------------------------------------------------------------------------------
# Opening


def nbytes(dtype: str, shape: Sequence[int]) -> int:
    return math.prod(shape) * itemsize(dtype, "manifest")


# ---------------------------------------------------------------------------------------------
# ls


@dataclass
class StepInfo:
    step: int
    path: str
    status: str  # "committed", "partial" (no manifest: a save that never finished) or "unreadable"
    size: int
    created: str | None
    age_s: float | None
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def list_steps(root: str | os.PathLike[str]) -> list[StepInfo]:
    """The step directories under the run directory ``root``, oldest step first."""
    storage = storage_for(root)
    if not isinstance(storage, LocalStorage):
        return _list_remote_steps(storage)
    r = Path(user_path(root))
    try:
        if not r.is_dir():
            what = "does not exist" if not r.exists() else "is a file"
            raise CheckpointNotFoundError(f"no run directory at {r}: the path {what} (give a CheckpointManager root)")
        if (r / MANIFEST_NAME).exists():
            raise CheckpointError(f"{r} is a checkpoint, not a run directory; show it with: stashpoint inspect {r}")
    except OSError as e:  # the directory unreadable: the fix named, not errno's words alone
        raise read_failed(f"the run directory {r}", e) from None
    now = time.time()
    out = []
    for name, step in _steps_of(LocalStorage(r)):
        d = r / name
        try:
            files = [d / f for f in LocalStorage(d).list()]  # group directories' files too
            stats = [st for f in files if (st := _lstat(f)) is not None]
            info = StepInfo(step, str(d), "partial", sum(st.st_size for st in stats), None, None)
            info.age_s = now - max([d.stat().st_mtime] + [st.st_mtime for st in stats])
            if (d / MANIFEST_NAME).exists():
                _describe_committed(info, LocalStorage(d), now)
        except (OSError, CheckpointError) as e:
            if not d.exists():  # removed while listed (the manager's retention, as it runs)
                continue
            # one step that cannot be read (permissions) is a row saying so, not the end of the listing
            info = StepInfo(step, str(d), "unreadable", 0, None, None, error=f"{type(e).__name__}: {e}")
        out.append(info)
    return sorted(out, key=lambda s: s.step)


def _lstat(path: Path) -> os.stat_result | None:
    """``path``'s lstat, or None for a file removed since it was listed."""
    try:
        return path.lstat()
    except FileNotFoundError:
        return None


def _list_remote_steps(root: Storage) -> list[StepInfo]:
    if root.exists(MANIFEST_NAME):
        raise CheckpointError(
            f"{root.location} is a checkpoint, not a run directory; show it with: stashpoint inspect {root.location}"
        )
    names = root.children()
    if not names and not root.list():
        raise CheckpointNotFoundError(f"no run directory at {root.location}: nothing is stored there")
    now = time.time()
    out = []
    for name, step in _steps_of(root):
        d = root.child(name)
        try:
            files = d.sizes()  # one listing, not a request per file
            info = StepInfo(step, d.location, "partial", sum(files.values()), None, None)
            if MANIFEST_NAME in files:
                _describe_committed(info, d, now)
        except (OSError, CheckpointError) as e:
            if not d.exists():  # removed while listed (the manager's retention, as it runs)
                continue
            # one step that cannot be read (permissions) is a row saying so, not the end of the listing
            info = StepInfo(step, d.location, "unreadable", 0, None, None, error=f"{type(e).__name__}: {e}")
        out.append(info)
    return sorted(out, key=lambda s: s.step)


def _steps_of(root: Storage) -> tuple[tuple[str, int], ...]:
    """The step directories the manager would act on (as ``verify`` sees them)."""
    run = run_contents(root)
    return run.steps if run is not None else ()


def _describe_committed(info: StepInfo, d: Storage, now: float) -> None:
    try:
        head = read_summary(d)  # a listing reads no index, nor parses the catalog (steps x tensors)
    except CheckpointError as e:
        info.status, info.error = "unreadable", str(e)
        return
    info.status, info.created = "committed", head["created"]
    try:
        info.age_s = now - datetime.fromisoformat(head["created"]).timestamp()
        info.metrics = parse_metrics(head["metadata"].get(METRICS_KEY, "{}"))
    except ValueError:  # a foreign "created" or metrics string: shown without
        pass


# ---------------------------------------------------------------------------------------------
# inspect


def _leafy(node: Node) -> bool:
    """A value shown whole: a leaf, or a list/tuple of such (a dict is shown key by key)."""
    for kind in ("list", "tuple"):
        if kind in node:
            return all(_leafy(c) for c in node[kind])
    return not any(k in node for k in ("dict", "tensor", "stateful"))


def plain_values(tree: Node, *, typed: bool = False) -> dict[str, Node]:
    """Every non-tensor value of a tree, by key path, as its raw node. An empty key shows as
    ``''``, and a key that is not a string as ``1 (int key)`` where a string key of the same
    dict prints alike (``typed``: always, for diff, whose two trees may differ in that alone);
    paths that still print alike get a suffix, and an empty dict is a value of its own."""
    out: dict[str, Node] = {}

    def put(where: str, node: Node) -> None:
        key, n = where or "<root>", 2
        while key in out:
            key, n = f"{where or '<root>'} ({n})", n + 1
        out[key] = node

    def walk(node: Node, where: str) -> None:
        if "tensor" in node:
            return
        if "stateful" in node:
            walk(node["state"], where)
        elif node.get("dict"):
            texts = {k for k, _ in node["dict"] if isinstance(k, str)}
            for k, v in node["dict"]:
                shown = "''" if k == "" else k
                if not isinstance(k, str) and (typed or str(k) in texts):
                    walk(v, join(where, shown) + f" ({type(k).__name__} key)")
                else:
                    walk(v, join(where, shown))
        elif "dict" not in node and not _leafy(node):
            for i, v in enumerate(node["list"] if "list" in node else node["tuple"]):
                walk(v, join(where, i))
        else:
            put(where, node)

    walk(tree, "")
    return out


def decode_value(node: Node, where: str) -> Any:
    """A plain node's value; a pickled value is never unpickled (``PICKLED`` instead)."""
    if "pickle" in node:
        return PICKLED
    for kind, make in (("list", list), ("tuple", tuple)):
        if kind in node:
            return make(decode_value(c, where) for c in node[kind])
    if "dict" in node:
        return {k: decode_value(v, where) for k, v in node["dict"]}
    return decode_plain(node, allow_pickle=False, where=where)


def jsonable(value: Any) -> Any:
    """``value`` with tuples as lists, bytes and non-finite floats as their repr."""
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, bytes):
        return Shown(repr(value) if len(value) <= 64 else f"<{len(value)} bytes>")
    if isinstance(value, float) and not math.isfinite(value):
        return Shown(repr(value))
    return value


def describe(path: str | os.PathLike[str], rank: int = 0) -> dict[str, Any]:
    """Everything about a checkpoint, as JSON-able data (``rank``: whose plain values)."""
    storage, m, elsewhere = open_here(path, rank)
    if not 0 <= rank < m.world_size:
        raise ValueError(f"rank {rank} is out of range: {path} was saved by {m.world_size} rank(s)")
    tensors = []
    for key, e in m.tensors.items():
        n = len(e.chunks)
        sharding = f"alias of {e.alias_of}" if e.alias_of else f"{n} chunk" + ("s" if n != 1 else "")
        size = 0 if e.alias_of else nbytes(e.dtype, e.shape)
        tensors.append({"key": key, "dtype": e.dtype, "shape": list(e.shape), "sharding": sharding, "bytes": size})
    where = storage.location
    values = {k: jsonable(decode_value(v, where)) for k, v in plain_values(m.tree_for(rank)).items()}
    return {
        "recoverable_without_storage": _recoverable(storage),
        "path": where,
        "format_version": m.format_version,
        "save_id": m.save_id,
        "created": m.created,
        "library_version": m.library_version,
        "torch_version": m.torch_version,
        "world_size": m.world_size,
        "distinct_rank_trees": len(m.trees),
        "rank": rank,
        "total_bytes": sum(t["bytes"] for t in tensors),
        "tensors": tensors,
        "values": values,
        "metadata": dict(m.metadata),
        "files": [{"name": f.name, "rank": f.rank, "size": f.size} for f in m.files],
        "ranks_elsewhere": list(elsewhere),
    }


def open_here(path: str | os.PathLike[str], rank: int = 0) -> tuple[Storage, Manifest, tuple[int, ...]]:
    """The checkpoint at ``path``; where some ranks' indexes are not here (one node's directory
    of a node-local run), what this directory holds, and the ranks whose files are elsewhere.
    The values shown are ``rank``'s if its index is here, else the first rank's here.

    Raises:
        IndexMissingError: a rank's index is missing while its shard files are here: the
            checkpoint is damaged, not one node's part of it.
    """
    try:
        storage, m = open_checkpoint(path)
        return storage, m, ()
    except IndexMissingError:
        storage = storage_for(path)
        head = read_head(storage)
        assert isinstance(head, Head)  # a missing index: format version 2
    have = {}
    for r in range(head.world_size):
        with contextlib.suppress(IndexMissingError):
            have[r] = read_index(storage, head, r)
    if not have:
        raise CheckpointError(f"{storage.location} holds none of its ranks' indexes: not a checkpoint to inspect here")
    shown = rank if rank in have else min(have)
    missing = tuple(r for r in range(head.world_size) if r not in have)
    lost = _shards_without_index(storage, head.save_id, missing)
    if lost:
        raise IndexMissingError(
            f"{storage.location}: the index of {ranks_text(list(lost))} is missing while its shard files are "
            "here: the checkpoint is damaged (a node's part of a node-local run holds neither); "
            "`stashpoint verify` checks the rest"
        )
    return storage, assemble(head, have, tree_rank=shown), missing


def _shards_without_index(storage: Storage, save_id: str, missing: Sequence[int]) -> tuple[int, ...]:
    """The ranks of ``missing`` whose shard files of this save are here all the same (and not
    marked as another node's: a copy landing in part, ``partial-rNNNNN``, or a replica being
    dropped, ``replica-rNNNNN``, whose index goes first)."""
    leaves = [n.rpartition("/")[2] for n in storage.tree() or []]  # None: cannot list: not told apart
    ranks = {p[0] for n in leaves if (p := parse_shard_name(n)) is not None and p[2] == save_id}
    ranks -= {int(m[1]) for n in leaves if (m := PARTIAL_RE.fullmatch(n) or REPLICA_RE.fullmatch(n)) is not None}
    return tuple(r for r in missing if r in ranks)


def _recoverable(storage: Storage) -> dict[str, int] | None:
    """A node-local step's claim to have live copies of every node's files on other nodes."""
    try:
        doc = json.loads(storage.read(RECOVERABLE_NAME, 0, 4096)) if storage.exists(RECOVERABLE_NAME) else None
    except (OSError, ValueError, RecursionError, CheckpointError):
        return None

    def count(v: object) -> bool:  # an int a file of ours could hold
        return type(v) is int and 0 <= v < 1 << 63

    if not (isinstance(doc, dict) and all(count(doc.get(k)) for k in ("replicas", "nodes"))):
        return None
    keys = ("replicas", "nodes", "own_bytes", "replica_bytes")
    return {k: doc[k] for k in keys if count(doc.get(k))}
