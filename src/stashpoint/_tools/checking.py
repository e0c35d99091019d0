"""What ``stashpoint verify`` (and :func:`stashpoint.verify`) does: every byte of a checkpoint
against its checksums and its manifest, every problem listed, none raised."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from stashpoint._core.format import CHECKSUM_BLOCK_BYTES, Chunk, FileEntry, Manifest, block_checksums
from stashpoint._core.naming import MANIFEST_NAME, is_node_marker, parse_step_dir
from stashpoint._core.nodes import unreadable_values
from stashpoint._core.units import human_bytes
from stashpoint._dist.arrival import ranks_text
from stashpoint._load.manifest import open_checkpoint, read_summary, shard_problem, unlisted_shards
from stashpoint._manager.runcheck import RunContents, run_contents
from stashpoint._storage import LocalStorage, Storage, storage_for
from stashpoint._tools import progress as _progress
from stashpoint._tools.inspect import Progress, open_here
from stashpoint.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError


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


def verify(path: str | os.PathLike[str], progress: Progress | None = None, *, this_node: bool = False) -> VerifyReport:
    """Check a checkpoint completely; every problem found is listed (none raised) in the report.

    ``path`` may also be the run directory of a :class:`~stashpoint.CheckpointManager`: then every
    committed step is checked, and partial steps and names the manager did not write (which it
    ignores) are listed as warnings. Raises only when ``path`` is neither (missing, a file, no
    manifest).

    ``this_node``: ``path`` is one node's directory of a ``node_local=True`` run (or one of its
    steps), which holds its own ranks' files only: the ranks whose indexes are here are checked,
    and the others are listed as a warning, not a problem.
    """
    run = run_contents(storage_for(path))
    if run is not None:
        return _verify_run(storage_for(path), run, progress, this_node)
    say = progress or (lambda _: None)
    try:
        storage, m, elsewhere = open_here(path) if this_node else (*open_checkpoint(path), ())
    except CorruptCheckpointError as e:
        return VerifyReport(str(path), problems=[str(e)])
    rep = VerifyReport(storage.location, files=len(m.files), tensors=len(m.tensors))
    if elsewhere:
        rep.warnings.append(
            f"{storage.location}: the files of {len(elsewhere)} of its {m.world_size} ranks are on other nodes "
            f"({ranks_text(list(elsewhere))}): not checked here"
        )
    _check_whole(storage.location, m, rep, whole=not elsewhere)
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
    if rep.problems and _removed(storage):  # a retention's delete meanwhile: no damage found, nothing to check
        raise CheckpointNotFoundError(
            f"{storage.location} was removed while it was checked (a CheckpointManager's retention, or a delete); "
            "the files it lost meanwhile are no damage, and nothing is left to check"
        )
    if rep.problems and _replaced(storage, m):  # a save with overwrite=True committed meanwhile: no damage
        return VerifyReport(
            storage.location,
            problems=[
                f"{storage.location}: the checkpoint was replaced while it was checked (a save with overwrite=True "
                "committed meanwhile); check it again"
            ],
        )
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


def _removed(storage: Storage) -> bool:
    """Whether the checkpoint at ``storage`` has no manifest now (it had one when the check began)."""
    try:
        return not storage.exists(MANIFEST_NAME)
    except OSError:
        return False  # unreachable now: the problems found stand


def _replaced(storage: Storage, m: Manifest) -> bool:
    """Whether the checkpoint at ``storage`` is now another save's than ``m``'s (its manifest
    alone: the indexes need not be read again to tell)."""
    try:
        return bool(read_summary(storage)["save_id"] != m.save_id)
    except (OSError, CheckpointError):
        return False  # gone or damaged now: the problems found stand


def _check_whole(where: str, m: Manifest, rep: VerifyReport, *, whole: bool = True) -> None:
    """What a load would refuse beyond the checksums: a tensor whose chunks do not cover it (the
    catalog promises bytes no index holds; only where every index is here), a plain value that
    does not decode."""
    for key, entry in m.tensors.items() if whole else ():
        held = sum(math.prod(c.shape) for c in entry.chunks)
        if entry.alias_of is None and held != math.prod(entry.shape):
            rep.problems.append(
                f"{where}: the chunks of {key!r} hold {held} of its {math.prod(entry.shape)} elements (the manifest "
                "promises bytes no shard holds: the checkpoint is damaged)"
            )
    for tree in m.trees:
        for at in unreadable_values(tree):
            rep.problems.append(f"{where}: the value at {at!r} does not decode (the manifest is damaged)")


def _verify_run(root: Storage, run: RunContents, progress: Progress | None, this_node: bool) -> VerifyReport:
    if not any(root.child(name).exists(MANIFEST_NAME) for name, _ in run.steps):
        partial = ", ".join(name for name, _ in run.steps[-3:]) or "none"
        raise CheckpointNotFoundError(
            f"{root.location} is a run directory with no committed step (partial ones: {partial}); nothing to verify"
        )
    rep = VerifyReport(root.location, steps=0)
    for name, step in run.steps:
        child = root.child(name)
        try:
            if not child.exists(MANIFEST_NAME):
                rep.warnings.append(
                    f"{child.location}: step {step} is partial (no {MANIFEST_NAME}: a save that never committed); "
                    "restore skips it and the manager removes it"
                )
                continue
            where = str(child.root) if isinstance(child, LocalStorage) else child.location
            sub = verify(where, progress, this_node=this_node)
        except (OSError, CheckpointError) as e:
            sub = None
            try:
                there = child.exists(MANIFEST_NAME)
            except OSError:
                there = True
            if there:  # one step that cannot be checked is its problem, not the end of the run's check
                rep.problems.append(f"step {step}: could not be checked: {type(e).__name__}: {e}")
                continue
        if sub is None or (sub.problems and not child.exists(MANIFEST_NAME)):  # its manifest goes first
            rep.warnings.append(f"{child.location}: step {step} was removed while it was checked (retention)")
            continue
        rep.steps = (rep.steps or 0) + 1
        rep.files, rep.tensors = rep.files + sub.files, rep.tensors + sub.tensors
        rep.bytes_checked += sub.bytes_checked
        rep.problems += [f"step {step}: {p}" for p in sub.problems]
        rep.warnings += [f"step {step}: {w}" for w in sub.warnings]
    for name in run.set_aside:
        what = "a damaged step"
        if ".rewound-" in name:
            what = "a step of a run abandoned by a rewind"
        elif ".incomplete-" in name:
            what = "a step some of whose ranks' files no node of a later job held"
        rep.warnings.append(f"{root.location}/{name}: {what} the manager set aside, kept for inspection")
    for name in run.foreign:
        why = (
            "a file or a link, not a directory" if parse_step_dir(name) is not None else "not a step-XXXXXXXX directory"
        )
        rep.warnings.append(
            f"{root.location}/{name} was not written by stashpoint's manager ({why}); the manager ignores it"
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
    for i, (key, c) in enumerate(chunks):
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
        except OSError as e:  # the file as a whole (gone, unreadable): one line, not one per key
            rest = len(chunks) - i - 1
            more = f"; the {rest} key(s) after it in this shard were not read" if rest else ""
            rep.problems.append(f"reading {key!r} from shard {where} failed: {e}{more}")
            break
        if bad:
            b0 = c.start + bad[0] * CHECKSUM_BLOCK_BYTES
            rep.problems.append(
                f"checksum mismatch for key {key!r} in shard {where}: {len(bad)} of {len(c.checksums)} block(s) "
                f"damaged, the first at file bytes {b0}-{min(b0 + CHECKSUM_BLOCK_BYTES, c.end)}"
            )
    if cut:
        rep.problems.append(f"shard {where} ends before the data of {_keys_text(cut)} (truncated)")
