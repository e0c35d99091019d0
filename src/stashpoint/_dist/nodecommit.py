"""The commit of a save to node-local directories: every node holds the manifest, or the save failed.

Rank 0 commits in its node's directory first (as any save); then the manifest's bytes reach the
leader of every other node through a doubling tree of the leaders (rank 0 sends to one, both
send on, and so on: log2(nodes) rounds, and no leader sends more than that many copies, where
rank 0 used to send one to every node), each leader commits them in its own directory, and
every rank learns whether all did. A step is the job's
only when every node holds its manifest: a crash in between leaves it on some nodes only, and
a restore, which asks every node, passes it by.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from stashpoint._core.naming import MANIFEST_NAME
from stashpoint._core.nodeplan import Room, replica_bytes
from stashpoint._core.sealed import MAX_MANIFEST_BYTES
from stashpoint._dist.group import DistContext
from stashpoint._dist.nodes import NodeSave, recv_blob, send_blob
from stashpoint._storage import Storage
from stashpoint.errors import CheckpointError


def tree_parent(at: int) -> int:
    """The place in the doubling tree that ``at`` (> 0) receives from: ``at`` without its top bit."""
    return at - (1 << (at.bit_length() - 1))


def tree_children(at: int, n: int) -> list[int]:
    """The places ``at`` sends to, in the order of the rounds: ``at + 2**r`` for each round
    ``r`` after the one it received in (every round, at the root)."""
    first = 0 if at == 0 else at.bit_length()
    out = []
    while at + (1 << first) < n:
        out.append(at + (1 << first))
        first += 1
    return out


def tree_places(at: int, n: int) -> range:
    """``at`` and every place below it in the tree, whose rooms it passes on."""
    return range(n) if at == 0 else range(at, n, 1 << at.bit_length())


def _pack_rooms(rooms: dict[int, Room], places: range) -> bytes:
    return b"".join(struct.pack("<QQ", *rooms[p]) for p in places) if rooms else b""


def _unpack_rooms(raw: bytes, at: int, n: int) -> dict[int, Room]:
    places = tree_places(at, n)
    if len(raw) != 16 * len(places):
        return {}  # a save without replicas counts no room
    return {p: struct.unpack_from("<QQ", raw, 16 * i) for i, p in enumerate(places)}


def node_room(ns: NodeSave, rank_bytes: Sequence[int]) -> dict[int, Room]:
    """Rank 0: each node's own bytes of the step (from every rank's) and the bytes of other
    nodes' files it will keep as replicas, by its leader's rank."""
    own = {node: 0 for node, _ in ns.nodes.leaders}
    for rank, n in enumerate(rank_bytes):
        own[ns.nodes.of_rank[rank]] += n
    incoming = replica_bytes(own, ns.replicas)
    return {leader: (own[node], incoming[node]) for node, leader in ns.nodes.leaders}


def commit_on_nodes(
    ctx: DistContext,
    storage: Storage,
    manifest: bytes | None,
    leaders: Sequence[int],
    room: dict[int, Room] | None,
    *,
    exclusive: bool,
) -> Room | None:
    """After rank 0 committed ``manifest`` (its bytes, on rank 0) in ``storage`` of its node:
    the same bytes into ``storage`` of every other node, by their ``leaders`` (group ranks),
    with each node's ``Room`` where rank 0 has ``room`` (a save with replicas). Returns
    this leader's room (None elsewhere, or without). Raises :class:`CheckpointError` on every
    rank alike when any node's commit failed."""
    status: str | None = None
    mine: Room | None = None
    order = [0, *sorted(r for r in leaders if r != 0)]  # the tree's places: rank 0 at the root
    if ctx.rank in order:
        at = order.index(ctx.rank)
        rooms: dict[int, Room] = {}
        failed: list[str] = []
        try:
            if at == 0:
                assert manifest is not None
                data = manifest
                rooms = {i: room[r] for i, r in enumerate(order)} if room is not None else {}
            else:
                parent = order[tree_parent(at)]
                data = recv_blob(ctx, parent, MAX_MANIFEST_BYTES)
                rooms = _unpack_rooms(recv_blob(ctx, parent, 16 * len(tree_places(at, len(order)))), at, len(order))
        except Exception as e:  # nothing to pass on: the subtree's leaders fail at their receive
            status = f"rank {ctx.rank}: receiving the manifest: {type(e).__name__}: {e}"
        else:
            for child in tree_children(at, len(order)):
                try:  # the others still get it: a step on fewer nodes is no worse
                    send_blob(ctx, order[child], data)
                    send_blob(ctx, order[child], _pack_rooms(rooms, tree_places(child, len(order))))
                except CheckpointError as e:
                    failed.append(str(e))
            mine = rooms.get(at)
            try:
                if at != 0:
                    storage.commit(MANIFEST_NAME, data, exclusive=exclusive)
            except Exception as e:
                failed.insert(0, f"rank {ctx.rank}: {type(e).__name__}: {e}")
            if failed:
                status = "; ".join(failed[:4])
    statuses = ctx.gather("node-local: the nodes' commits", status)
    verdict = None
    if statuses is not None:
        bad = [s for s in statuses if s is not None]
        verdict = "; ".join(bad[:8])[:4000] if bad else None
    verdict = ctx.broadcast("node-local: the commit's verdict", verdict)
    if verdict:
        raise CheckpointError(
            f"the save to {storage.location} committed on some nodes but not on every node ({verdict}); it is not "
            "a checkpoint of the job (a restore passes it by) and earlier steps are untouched"
        )
    return mine
