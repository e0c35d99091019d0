"""What each node's directory holds of each step (its inventory, with the checks that keep a
damaged copy from counting), the copies a node-local restore tries in order, and the remote
tier's copy of a step as one more holder."""

from __future__ import annotations

import logging
import re
from typing import Any

from stashpoint._core.format import Manifest
from stashpoint._core.naming import MANIFEST_NAME, PARTIAL_RE, REPLICA_RE, index_name, parse_save_file, step_dir
from stashpoint._core.nodeplan import Held, Transfer, coverable, expand, ranges
from stashpoint._dist.landing import mark_partial
from stashpoint._dist.transfer import RemoteCopy
from stashpoint._load.manifest import read_head, read_index
from stashpoint._manager.steps import committed_steps
from stashpoint._manager.upload import rank_problem
from stashpoint._storage import LocalStorage, Storage
from stashpoint.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError

log = logging.getLogger("stashpoint")


_NAMED_RANK = re.compile(r"(?:shard|index)-r([0-9]{5,})-")


def mark_damaged(root: Storage, step: int, error: str = "") -> None:
    """Check the ranks' files this node holds of ``step`` and mark the damaged ones partial
    (``partial-r<rank>``): no longer held here, fetched anew from a node that holds them whole.
    Only the ranks whose files ``error`` (the failed load's) names, where it names any: every
    byte is read, while the other ranks wait."""
    at = root.child(step_dir(step))
    if not isinstance(at, LocalStorage) or not at.exists(MANIFEST_NAME):
        return
    held = next((h for h in inventory(root) if h.step == step), None)
    ranks = expand(held.ranks) if held is not None else set()
    named = {int(m) for m in _NAMED_RANK.findall(error)} & ranks
    for r in sorted(named or ranks):
        problem = rank_problem(at, r)
        if problem is not None:
            log.warning(
                "stashpoint: this node's copy of rank %d of step %d is damaged (%s); marked partial", r, step, problem
            )
            mark_partial(at.root, r)


def inventory(root: Storage, damaged: dict[int, str] | None = None) -> tuple[Held, ...]:
    """Every committed step under this node's ``root`` and the saving ranks it holds whole;
    the steps whose manifest here is damaged, with why, into ``damaged``."""
    found = []
    steps = committed_steps(root)
    for step in steps:
        where = root.child(step_dir(step))
        try:
            # two fields of each: only the newest step's (the one a restore takes, mostly) is kept
            # parsed for the restore's passes, not every step's
            head = read_head(where, remember=step == steps[-1])
        except (CorruptCheckpointError, IncompleteCheckpointError) as e:
            # nothing of the step here is usable (unreadable: listing fails); said, as the step may
            # now lack this node's ranks on every node
            log.warning("stashpoint: this node's manifest of step %d is damaged (%s); its files here are not used",
                        step, e)  # fmt: skip
            if damaged is not None:
                damaged[step] = f"this node's manifest of it is damaged: {e}"
            continue
        whole, copies = held_ranks(where, head.save_id)
        found.append(Held(step, head.save_id, head.world_size, ranges(whole), ranges(copies & whole)))
    return tuple(found)


def held_ranks(where: Storage, save_id: str) -> tuple[set[int], set[int]]:
    """The saved ranks whose files of save ``save_id`` the step directory ``where`` holds whole
    (their index is there, and no mark says a copy is partial), and those it holds as replicas."""
    whole, partial, copies = set(), set(), set()
    for name in where.list():
        if (m := PARTIAL_RE.fullmatch(name)) is not None:
            partial.add(int(m[1]))
        if (m := REPLICA_RE.fullmatch(name)) is not None:
            copies.add(int(m[1]))
        parsed = parse_save_file(name)
        if parsed is not None and parsed[1] == save_id and name.rpartition("/")[2] == index_name(*parsed):
            whole.add(parsed[0])
    return whole - partial, copies


def node_order(
    by_node: dict[int, tuple[Held, ...]], remote: list[int], step: int | None
) -> tuple[list[tuple[int, str]], list[int]]:
    """The copies to try, newest step first: ``(step, "local")`` where the nodes hold the step
    between them, or hold part of it and the remote tier has it (the rest is read from there),
    then ``(step, "remote")`` where the remote tier has it; and the steps no restore can take
    (some rank's files are on no node, nor in the remote tier). Pure."""
    held = {h.step for hs in by_node.values() for h in hs}
    cover = coverable(by_node)
    steps = sorted(held | set(remote), reverse=True) if step is None else [step]
    order = []
    for s in steps:
        if s in cover or (s in held and s in remote):
            order.append((s, "local"))
        if s in remote:
            order.append((s, "remote"))
    return order, sorted(held - cover.keys() - set(remote))


def remote_copy(at: Storage) -> RemoteCopy:
    """The remote tier's copy ``at`` of a step, listing a transfer's whole files from its
    (verified) manifest and indexes: what a peer's listing would offer."""
    heads: list[Any] = []

    def files(t: Transfer) -> list[tuple[str, int]]:
        if not heads:
            heads.append(read_head(at))
        return remote_files(at, heads[0], t)

    return RemoteCopy(at, files)


def remote_files(remote: Storage, head: Any, t: Transfer) -> list[tuple[str, int]]:
    if isinstance(head, Manifest):
        raise CheckpointError(f"{remote.location} has a version-1 manifest; node-local restores read version 2")
    out = []
    for r in sorted(expand(t.ranks)):
        out += [(f.name, f.size) for f in read_index(remote, head, r).files]
    out += [(head.index_name(r), head.indexes[r][0]) for r in sorted(expand(t.ranks) | expand(t.indexes))]
    if t.manifest:
        out.append((MANIFEST_NAME, remote.size(MANIFEST_NAME)))
    return out
