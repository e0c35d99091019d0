"""What the ``stashpoint`` tool commands ls, inspect and verify do, and what the others share.

Pure functions that return data; the click commands in ``_cli`` print it. A bad path or a
checkpoint that cannot be opened raises a :class:`CheckpointError` subclass (a bad argument a
``ValueError``) whose message names the path and the fix. Nothing here unpickles a stashpoint
checkpoint: pickled values are shown as ``<pickled, not loaded>``.
"""

from __future__ import annotations

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
from stashpoint._core.format import (
    CHECKSUM_BLOCK_BYTES,
    Chunk,
    FileEntry,
    Manifest,
    block_checksums,
)
from stashpoint._core.naming import MANIFEST_NAME, RECOVERABLE_NAME, is_node_marker
from stashpoint._core.nodes import Node, decode_plain, join, unreadable_values
from stashpoint._core.policy import parse_metrics
from stashpoint._core.units import human_bytes
from stashpoint._load.manifest import open_checkpoint, read_head, shard_problem, unlisted_shards
from stashpoint._manager.runcheck import RunContents, run_contents
from stashpoint._manager.steps import METRICS_KEY
from stashpoint._storage import LocalStorage, Storage, storage_for
from stashpoint._tools import progress as _progress
from stashpoint.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError


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
    r = Path(root)
    if not r.is_dir():
        what = "does not exist" if not r.exists() else "is a file"
        raise CheckpointNotFoundError(f"no run directory at {r}: the path {what} (give a CheckpointManager root)")
    if (r / MANIFEST_NAME).exists():
        raise CheckpointError(f"{r} is a checkpoint, not a run directory; show it with: stashpoint inspect {r}")
    now = time.time()
    out = []
    for name, step in _steps_of(LocalStorage(r)):
        d = r / name
        files = [d / f for f in LocalStorage(d).list()]  # group directories' files too
        stats = [f.lstat() for f in files]
        info = StepInfo(step, str(d), "partial", sum(st.st_size for st in stats), None, None)
        info.age_s = now - max([d.stat().st_mtime] + [st.st_mtime for st in stats])
        if (d / MANIFEST_NAME).exists():
            _describe_committed(info, LocalStorage(d), now)
        out.append(info)
    return sorted(out, key=lambda s: s.step)


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
        files = d.list()
        info = StepInfo(step, d.location, "partial", sum(d.size(f) for f in files), None, None)
        if MANIFEST_NAME in files:
            _describe_committed(info, d, now)
        out.append(info)
    return sorted(out, key=lambda s: s.step)


def _steps_of(root: Storage) -> tuple[tuple[str, int], ...]:
    """The step directories the manager would act on (as ``verify`` sees them)."""
    run = run_contents(root)
    return run.steps if run is not None else ()


def _describe_committed(info: StepInfo, d: Storage, now: float) -> None:
    try:
        m = read_head(d)  # a listing reads no index
    except CheckpointError as e:
        info.status, info.error = "unreadable", str(e)
        return
    info.status, info.created = "committed", m.created
    try:
        info.age_s = now - datetime.fromisoformat(m.created).timestamp()
        info.metrics = parse_metrics(m.metadata.get(METRICS_KEY, "{}"))
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


def plain_values(tree: Node) -> dict[str, Node]:
    """Every non-tensor value of a tree, by key path, as its raw node."""
    out: dict[str, Node] = {}

    def walk(node: Node, where: str) -> None:
        if "tensor" in node:
            return
        if "stateful" in node:
            walk(node["state"], where)
        elif "dict" in node:
            for k, v in node["dict"]:
                walk(v, join(where, k))
        elif not _leafy(node):
            for i, v in enumerate(node["list"] if "list" in node else node["tuple"]):
                walk(v, join(where, i))
        else:
            out[where or "<root>"] = node

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
    storage, m = open_checkpoint(path)
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
    }


def _recoverable(storage: Storage) -> dict[str, int] | None:
    """A node-local step's claim to have live copies of every node's files on other nodes."""
    try:
        doc = json.loads(storage.read(RECOVERABLE_NAME, 0, 4096)) if storage.exists(RECOVERABLE_NAME) else None
    except (OSError, ValueError, CheckpointError):
        return None
    if not (isinstance(doc, dict) and all(type(doc.get(k)) is int for k in ("replicas", "nodes"))):
        return None
    keys = ("replicas", "nodes", "own_bytes", "replica_bytes")
    return {k: doc[k] for k in keys if type(doc.get(k)) is int}


# ---------------------------------------------------------------------------------------------
# verify


@dataclass
class VerifyReport:
    path: str
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    files: int = 0
    tensors: int = 0
    bytes_checked: int = 0
    steps: int | None = None  # committed steps checked, when ``path`` is a run directory

    @property
    def ok(self) -> bool:
        return not self.problems


_SPAN = 16 * CHECKSUM_BLOCK_BYTES  # bytes read at a time (whole checksum blocks)


def _keys_text(keys: Sequence[str]) -> str:
    shown = ", ".join(repr(k) for k in sorted(set(keys))[:5])
    return shown + (f" and {len(set(keys)) - 5} more" if len(set(keys)) > 5 else "")


def verify(path: str | os.PathLike[str], progress: Progress | None = None) -> VerifyReport:
    """Check a checkpoint completely; every problem found is listed (none raised) in the report.

    ``path`` may also be the run directory of a :class:`~stashpoint.CheckpointManager`: then every
    committed step is checked, and partial steps and names the manager did not write (which it
    ignores) are listed as warnings. Raises only when ``path`` is neither (missing, a file, no
    manifest).
    """
    run = run_contents(storage_for(path))
    if run is not None:
        return _verify_run(storage_for(path), run, progress)
    say = progress or (lambda _: None)
    try:
        storage, m = open_checkpoint(path)
    except CorruptCheckpointError as e:
        return VerifyReport(str(path), problems=[str(e)])
    rep = VerifyReport(storage.location, files=len(m.files), tensors=len(m.tensors))
    _check_whole(storage.location, m, rep)
    chunks: dict[str, list[tuple[str, Chunk]]] = {f.name: [] for f in m.files}
    for key, entry in m.tensors.items():
        for c in entry.chunks:
            chunks[c.file].append((key, c))
    total = sum(f.size for f in m.files)
    say(f"verifying {storage.location}: {len(m.files)} file(s), {len(m.tensors)} tensor(s), {human_bytes(total)}")
    _progress.start(progress, total)
    for i, fe in enumerate(m.files, 1):
        before = len(rep.problems)
        _verify_file(storage, m, fe, sorted(chunks[fe.name], key=lambda kc: kc[1].start), rep)
        found = len(rep.problems) - before
        status = "ok" if not found else f"{found} problem(s)"
        say(f"[{i}/{len(m.files)}] {fe.name} ({human_bytes(fe.size)}): {status}")
        _progress.advance(progress, fe.size)
    own = set(unlisted_shards(storage, m))
    for name in sorted(own):
        rep.problems.append(
            f"{storage.location}/{name}: a shard of this checkpoint's save that the manifest does not list "
            "(the manifest is damaged or incomplete)"
        )
    listed = {f.name for f in m.files} | {name for name, _ in m.indexes} | {MANIFEST_NAME} | own
    for name in storage.list():
        if name not in listed and not is_node_marker(name):
            rep.warnings.append(
                f"{storage.location}/{name} is not listed in the manifest (a leftover of an interrupted save?); "
                "it is not part of the checkpoint and may be deleted"
            )
    return rep


def _check_whole(where: str, m: Manifest, rep: VerifyReport) -> None:
    """What a load would refuse beyond the checksums: a tensor whose chunks do not cover it (the
    catalog promises bytes no index holds), a plain value that does not decode."""
    for key, entry in m.tensors.items():
        held = sum(math.prod(c.shape) for c in entry.chunks)
        if entry.alias_of is None and held != math.prod(entry.shape):
            rep.problems.append(
                f"{where}: the chunks of {key!r} hold {held} of its {math.prod(entry.shape)} elements (the manifest "
                "promises bytes no shard holds: the checkpoint is damaged)"
            )
    for tree in m.trees:
        for at in unreadable_values(tree):
            rep.problems.append(f"{where}: the value at {at!r} does not decode (the manifest is damaged)")


def _verify_run(root: Storage, run: RunContents, progress: Progress | None) -> VerifyReport:
    if not any(root.child(name).exists(MANIFEST_NAME) for name, _ in run.steps):
        partial = ", ".join(name for name, _ in run.steps[-3:]) or "none"
        raise CheckpointNotFoundError(
            f"{root.location} is a run directory with no committed step (partial ones: {partial}); nothing to verify"
        )
    rep = VerifyReport(root.location, steps=0)
    for name, step in run.steps:
        child = root.child(name)
        if not child.exists(MANIFEST_NAME):
            rep.warnings.append(
                f"{child.location}: step {step} is partial (no {MANIFEST_NAME}: a save that never committed); "
                "restore skips it and the manager removes it"
            )
            continue
        sub = verify(str(child.root) if isinstance(child, LocalStorage) else child.location, progress)
        rep.steps = (rep.steps or 0) + 1
        rep.files, rep.tensors = rep.files + sub.files, rep.tensors + sub.tensors
        rep.bytes_checked += sub.bytes_checked
        rep.problems += [f"step {step}: {p}" for p in sub.problems]
        rep.warnings += [f"step {step}: {w}" for w in sub.warnings]
    for name in run.set_aside:
        rep.warnings.append(f"{root.location}/{name}: a damaged step the manager set aside, kept for inspection")
    for name in run.foreign:
        rep.warnings.append(
            f"{root.location}/{name} was not written by stashpoint's manager (not a step-XXXXXXXX directory); "
            "the manager ignores it"
        )
    return rep


def _verify_file(
    storage: Storage, m: Manifest, fe: FileEntry, chunks: list[tuple[str, Chunk]], rep: VerifyReport
) -> None:
    where = f"{storage.location}/{fe.name}"
    try:
        problem, readable = shard_problem(storage, m, fe)
    except CheckpointError as e:  # unreadable here and now (permissions, ...): listed, the rest still checked
        rep.problems.append(str(e))
        return
    if problem is not None:
        rep.problems.append(problem)
    if not readable:
        return
    cut: list[str] = []
    buf = bytearray(min(_SPAN, max((c.end - c.start for _, c in chunks), default=0)))
    for key, c in chunks:
        bad: list[int] = []
        try:
            for lo in range(0, max(c.end - c.start, 1), _SPAN):
                n = min(_SPAN, c.end - c.start - lo)
                view = memoryview(buf)[:n]
                storage.read_into(fe.name, c.start + lo, view)
                first = lo // CHECKSUM_BLOCK_BYTES
                sums = block_checksums(view)
                bad += [first + j for j, s in enumerate(sums) if s != c.checksums[first + j]]
                rep.bytes_checked += n
        except EOFError:
            cut.append(key)
            continue
        except OSError as e:
            rep.problems.append(f"reading {key!r} from shard {where} failed: {e}")
            continue
        if bad:
            b0 = c.start + bad[0] * CHECKSUM_BLOCK_BYTES
            rep.problems.append(
                f"checksum mismatch for key {key!r} in shard {where}: {len(bad)} of {len(c.checksums)} block(s) "
                f"damaged, the first at file bytes {b0}-{min(b0 + CHECKSUM_BLOCK_BYTES, c.end)}"
            )
    if cut:
        rep.problems.append(f"shard {where} ends before the data of {_keys_text(cut)} (truncated)")
