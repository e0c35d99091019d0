"""The commit of a save to node-local directories: every node holds the manifest, or the save failed.

Rank 0 commits in its node's directory first (as any save); then it sends the manifest's bytes
to the leader of every other node (one message per node, never one per rank), each leader
commits them in its own directory, and every rank learns whether all did. A step is the job's
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
    try:
        if ctx.rank == 0:
            assert manifest is not None
            failed = []
            mine = None if room is None else room[0]
            for leader in leaders:
                if leader == 0:
                    continue
                try:  # the others still get it: a step on fewer nodes is no worse
                    send_blob(ctx, leader, manifest)
                    send_blob(ctx, leader, b"" if room is None else struct.pack("<QQ", *room[leader]))
                except CheckpointError as e:
                    failed.append(str(e))
            if failed:
                status = "; ".join(failed[:4])
        elif ctx.rank in leaders:
            data = recv_blob(ctx, 0, MAX_MANIFEST_BYTES)
            sizes = recv_blob(ctx, 0, 16)
            mine = struct.unpack("<QQ", sizes) if len(sizes) == 16 else None
            storage.commit(MANIFEST_NAME, data, exclusive=exclusive)
    except Exception as e:
        status = f"rank {ctx.rank}: {type(e).__name__}: {e}"
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
